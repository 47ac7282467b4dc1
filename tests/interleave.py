"""Two writers of one commit, forced through a chosen interleaving of their steps.

Each writer is a thread with its own RunStore on the same URL. Its store's calls are hooked so that
every step waits for its turn in the schedule: ``check`` (the is-it-committed-already look at the
start of a commit), ``obj0``, ``obj1``, ... (the object writes) and ``manifest`` (the create-only
commit point). A writer that skips steps (it found the commit done) hands its remaining turns on.
"""

from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager
from typing import Any, Iterator

from spotlight.store import MANIFEST, Commit, RunStore

Step = tuple[str, str]  # (writer, step)


def steps(n_objects: int) -> tuple[str, ...]:
    return ("check", *(f"obj{i}" for i in range(n_objects)), "manifest")


def interleavings(n_objects: int, writers: tuple[str, str] = ("A", "B")) -> list[list[Step]]:
    """Every order of both writers' steps that keeps each writer's own steps in order
    (C(2k, k) for k steps per writer: 20 with one object each, 70 with two)."""
    a, b = writers
    k = len(steps(n_objects))
    out = []
    for positions in itertools.combinations(range(2 * k), k):
        own = {a: iter(steps(n_objects)), b: iter(steps(n_objects))}
        out.append([(w, next(own[w])) for w in (a if i in positions else b for i in range(2 * k))])
    return out


class Schedule:
    def __init__(self, order: list[Step]):
        self.order, self.pos, self.skipped = order, 0, set()
        self.cond = threading.Condition()

    def _advance(self) -> None:
        while self.pos < len(self.order) and self.order[self.pos] in self.skipped:
            self.pos += 1

    @contextmanager
    def turn(self, writer: str, step: str) -> Iterator[None]:
        with self.cond:
            self._advance()
            assert self.cond.wait_for(lambda: self.pos < len(self.order) and self.order[self.pos] == (writer, step),
                                      timeout=30), f"{writer}-{step} never got its turn in {self.order}"
        try:
            yield
        finally:
            with self.cond:
                self.pos += 1
                self._advance()
                self.cond.notify_all()

    def finish(self, writer: str) -> None:
        """The writer is done: whatever steps it did not take are skipped."""
        with self.cond:
            self.skipped |= {step for step in self.order if step[0] == writer}
            self._advance()
            self.cond.notify_all()


def hook(store: RunStore, writer: str, schedule: Schedule) -> RunStore:
    """Make the store's commit steps wait for their turns (instance attributes shadow the methods)."""
    is_committed, write_bytes, create_bytes = store.is_committed, store.write_bytes, store.create_bytes
    objects, checked = itertools.count(), []

    def hooked_is_committed(name: str) -> bool:
        if checked:
            return is_committed(name)
        checked.append(name)
        with schedule.turn(writer, "check"):
            return is_committed(name)

    def hooked_write_bytes(key: str, data: bytes) -> None:
        with schedule.turn(writer, f"obj{next(objects)}"):
            write_bytes(key, data)

    def hooked_create_bytes(key: str, data: bytes) -> None:
        if not key.endswith(MANIFEST):
            return create_bytes(key, data)
        with schedule.turn(writer, "manifest"):
            return create_bytes(key, data)

    store.is_committed, store.write_bytes, store.create_bytes = (  # type: ignore[method-assign]
        hooked_is_committed, hooked_write_bytes, hooked_create_bytes)
    return store


def race(url: str, name: str, objects: dict[str, dict[str, bytes]], order: list[Step],
         **commit_kwargs: Any) -> dict[str, Commit | BaseException]:
    """Both writers commit ``name`` (writer -> its objects) in ``order``; returns what each got."""
    schedule = Schedule(order)
    results: dict[str, Commit | BaseException] = {}

    def write(writer: str) -> None:
        store = hook(RunStore(url), writer, schedule)
        try:
            results[writer] = store.commit(name, objects[writer], {"writer": writer}, **commit_kwargs)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            results[writer] = e
        finally:
            schedule.finish(writer)

    threads = [threading.Thread(target=write, args=(w,)) for w in objects]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def writers_objects(n_objects: int) -> dict[str, dict[str, bytes]]:
    """Two writers' objects for one commit: the same names, different bytes (another GPU type's bf16)."""
    names = ["policy.safetensors", "metrics.json", "optimizer.safetensors"][:n_objects]
    return {w: {obj: f"{obj} of {w} ".encode() * (50 + i) for i, obj in enumerate(names)} for w in ("A", "B")}


def assert_one_winner(url: str, name: str, objects: dict[str, dict[str, bytes]], order: list[Step],
                      results: dict[str, Commit | BaseException]) -> str:
    """The commit loads and equals exactly one writer's (the first to create the manifest), for a fresh
    reader and for both writers; the loser's attempt is gone. Returns the winner."""
    failed = {w: r for w, r in results.items() if isinstance(r, BaseException)}
    assert not failed, f"{order}: {failed!r}"
    winner = next(w for w, step in order if step == "manifest")
    commit = RunStore(url).load(name)
    assert commit.meta["writer"] == winner, order
    for seen in (commit, *results.values()):
        assert isinstance(seen, Commit) and seen.meta["writer"] == winner, order
        assert {obj: seen.read(obj) for obj in objects[winner]} == objects[winner], order  # every byte checked
    assert RunStore(url).list(name) == sorted([MANIFEST, commit.manifest["attempt"]]), \
        f"{order}: the losing attempt was left behind"
    return winner
