"""The worker pool's records in the run store: what the flow, the pool and the workers tell each other.

A leaf (it needs only the store): the stage queue, the cost ledger, the workers and the pool
(``tasks/workers.py``) all read these, and none of them needs the others to do so.

Layout, under the run store::

    pool/done.json           the flow is over: workers exit
    pool/broken.json         a worker could not be kept alive: waiting stages fail with it
    pool/board.json          rewritten whenever the flow posts work or the pool changes: the flow's last
                             notices, numbered (what was posted, for whom, what has settled); idle workers
                             read it instead of listing the run's queues
    pool/slots/{slot}.json   a worker slot's instance and price (written by the pool, read by the ledger)
    workers/{worker}.json    a worker is ready: imports done, run opened (host, pid, time)

And how often anyone waiting on the store looks again (:class:`Pacer`): waiting costs requests, and S3
bills each one.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from spotlight.store import RequestCounts, RunStore, StoreError, counting_requests, json_bytes

POOL_DONE, POOL_BROKEN, POOL_SLOTS, BOARD = "pool/done.json", "pool/broken.json", "pool/slots", "pool/board.json"
#: S3: look again after a tenth of the time waited so far, from 2 s up to 4 s (a look is a request; a stage
#: on a real model lasts minutes, so 2 s late is little)
S3_POLL, LOCAL_POLL = (2.0, 4.0), (0.02, 0.02)
BOARD_KEEP = 64  # notices the board carries: a reader further behind lists the run's work instead


def poll_range(store: RunStore) -> tuple[float, float]:
    """(shortest, longest) seconds between two looks at the store: a local disk is cheap to poll, S3
    requests cost ~20 ms and money. ``SPOTLIGHT_POLL_SECONDS`` overrides it: ``LOW`` or ``LOW:HIGH``
    (e.g. an S3-compatible server on the same machine)."""
    default = LOCAL_POLL if store.is_local else S3_POLL
    spec = os.environ.get("SPOTLIGHT_POLL_SECONDS")
    if not spec:
        return default
    low, _, high = spec.partition(":")
    return float(low), max(float(low), float(high) if high else default[1])


def default_poll_seconds(store: RunStore) -> float:
    """The shortest time between two looks at the store (:func:`poll_range`)."""
    return poll_range(store)[0]


@dataclass
class Pacer:
    """How long to wait before looking again: a tenth of the time waited since the last change (``reset``),
    between ``low`` and ``high``. A change is then noticed at most ~10% (or ``low``) late, and a wait of T
    seconds costs about 10 ln(T / 10 low) + T / high looks: O(log T) for the short waits of a busy run,
    1/high per second for the long ones."""

    low: float
    high: float
    since: float = field(default_factory=time.monotonic)

    def reset(self) -> None:
        self.since = time.monotonic()

    def next(self) -> float:
        return min(self.high, max(self.low, 0.1 * (time.monotonic() - self.since)))


class WaitMeter:
    """This process's time spent waiting on the store (for a stage, for an exploration) and the S3 requests
    the waiting threads sent meanwhile: what waiting costs, apart from the process's other work, done in
    other threads at the same time (the controller's ledger entries carry it)."""

    def __init__(self) -> None:
        self.seconds, self.requests = 0.0, RequestCounts()
        self._lock = threading.Lock()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = time.monotonic()
        with counting_requests() as sent:
            try:
                yield
            finally:
                with self._lock:
                    self.seconds += time.monotonic() - t0
                    self.requests = self.requests + sent()


WAITING = WaitMeter()


def pacer(store: RunStore, poll_seconds: float | None = None) -> Pacer:
    """The store's :func:`poll_range`, or a flat ``poll_seconds``."""
    return Pacer(*poll_range(store)) if poll_seconds is None else Pacer(poll_seconds, poll_seconds)


#: per run store URL: this process's board (its writer id and its last notices)
_BOARDS: dict[str, tuple[str, list[dict[str, Any]]]] = {}
_BOARD_LOCK = threading.Lock()


def post_notice(store: RunStore, what: str, kind: str = "pool", **fields: Any) -> None:
    """Add a notice to the board and rewrite it: the flow posted work (``kind`` stage, exploration, join),
    an item was handed back (freed), or the pool changed (pool: its readers list the run's work). The
    notice also names what this process saw settle since its last (:func:`saw_settled`).

    The board carries this process's last BOARD_KEEP notices, numbered, so a reader of an older version
    applies the ones it missed without listing; a board another process wrote (a restarted flow) or a
    gap makes its readers list. Written after the change it announces, so a reader finds the change."""
    with _BOARD_LOCK:  # one version at a time, in order: S3 keeps the last write
        writer, notices = _BOARDS.setdefault(store.url, (secrets.token_hex(8), []))
        settled = _SETTLED.pop(store.url, [])
        notices.append({"seq": notices[-1]["seq"] + 1 if notices else 1, "kind": kind, "what": what,
                        "at": time.time(), **fields, **({"settled": settled} if settled else {})})
        del notices[:-BOARD_KEEP]
        store.write_bytes(BOARD, json_bytes({"writer": writer, "notices": notices}))


#: per run store URL: what this process's waiters saw settle since its last notice (stage attempts done or
#: failed, explorations drained: the next notice names them), and the commits they saw made
_SETTLED: dict[str, list[str]] = {}
_COMMITTED: dict[str, set[str]] = {}


def saw_settled(store: RunStore, name: str, commit: str | None = None) -> None:
    """A waiter of this process saw ``name`` (a stage attempt, an exploration queue's prefix) settle, having
    made ``commit``: the next notice tells the workers (they drop it unread), and this process knows the
    commit exists (:func:`seen_committed`)."""
    with _BOARD_LOCK:
        _SETTLED.setdefault(store.url, []).append(name)
        if commit is not None:
            _COMMITTED.setdefault(store.url, set()).add(commit)


def seen_committed(store: RunStore, name: str) -> bool:
    """Whether a waiter of this process saw a stage commit ``name`` (free; False says nothing)."""
    return name in _COMMITTED.get(store.url, ())


@dataclass
class BoardReader:
    """A worker's view of the board: each read is one GET, and returns the notices posted since the last."""

    store: RunStore
    raw: bytes | None = None
    writer: str | None = None
    seq: int = 0

    def read(self) -> list[dict[str, Any]] | None:
        """The notices posted since the last read ([] if none), or None: list the run's work instead (the
        first read, a board this reader cannot follow: another writer, a gap, no board, or a pool notice)."""
        try:
            raw = self.store.read_bytes(BOARD, small=True)
        except StoreError:
            raw = None
        if raw is not None and raw == self.raw:
            return []
        self.raw = raw
        try:
            body = json.loads(raw) if raw else {}
            writer, notices = body["writer"], [n for n in body["notices"] if isinstance(n.get("seq"), int)]
        except (ValueError, KeyError, TypeError, AttributeError):
            self.writer = None
            return None
        followed, last = writer == self.writer, self.seq
        new = [n for n in notices if n["seq"] > last]
        self.writer, self.seq = writer, notices[-1]["seq"] if notices else 0
        if not followed or (new and new[0]["seq"] != last + 1) or any(n.get("kind") == "pool" for n in new):
            return None
        return new


def pool_done(store: RunStore) -> bool:
    return store.exists(POOL_DONE)


def mark_pool_done(store: RunStore, reason: str) -> None:
    store.put_json(POOL_DONE, {"reason": reason, "at": time.time()})
    post_notice(store, "the pool is done")


#: the broken markers this process wrote (run store URL -> record): its own waiters learn of them for free
_BROKEN_HERE: dict[str, dict[str, Any]] = {}


def reset_pool(store: RunStore) -> None:
    """A flow starting (or resuming) the run: workers are wanted again."""
    store.delete(POOL_DONE)
    store.delete(POOL_BROKEN)
    _BROKEN_HERE.pop(store.url, None)
    post_notice(store, "the pool starts")


def mark_pool_broken(store: RunStore, slot: str, reason: str) -> None:
    record = {"slot": slot, "reason": reason, "at": time.time()}
    store.put_json(POOL_BROKEN, record)
    _BROKEN_HERE[store.url] = record
    post_notice(store, f"the pool is broken ({slot})")


def pool_broken(store: RunStore, read: bool = True) -> dict[str, Any] | None:
    """The pool's broken marker: the one this process wrote at no cost (the flow's own pool), else, when
    ``read``, one GET (a pool in another process)."""
    if store.url in _BROKEN_HERE:
        return _BROKEN_HERE[store.url]
    if not read:
        return None
    try:
        return store.get_json(POOL_BROKEN)
    except StoreError:
        return None


def write_slot(store: RunStore, slot: str, record: dict[str, Any]) -> None:
    """What the pool knows of a worker slot's current instance (kind, instance, price, where from)."""
    store.put_json(f"{POOL_SLOTS}/{slot}.json", record)


def read_slot(store: RunStore, slot: str) -> dict[str, Any] | None:
    try:
        return store.get_json(f"{POOL_SLOTS}/{slot}.json")
    except StoreError:
        return None


def ready_record_key(worker_id: str) -> str:
    """Where a worker records that it is ready (imports done, run opened): host, pid, time."""
    return f"workers/{worker_id}.json"
