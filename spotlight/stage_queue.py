"""GPU stages as work on the run store's queue: the flow posts a stage, a long-lived trainer pulls it.

Why: a stage that starts its own machine pays provisioning, setup and model loading every time (minutes
on a cloud) for work that may take one. Here the trainer workers (``spotlight worker --kind trainer``)
are started once per run and once per preemption; each stage of each iteration is a small work item
they claim, run and commit, with the same create-only claims and leases as exploration
(:mod:`spotlight.work_queue`).

Layout, under the run store::

    stages/{stage}-{t:04d}-a{NN}/            attempt NN of a stage: a WorkQueue with one item, one unit
    stages/{stage}-{t:04d}-a{NN}/failed.json the attempt failed: worker, error, traceback tail (create-only)

(the pool's markers, ``pool/``, are :mod:`spotlight.pool`'s.)

Posting is idempotent: ``post`` returns the newest attempt unless it failed, so a Prefect retry or a
restarted flow waits on the work in flight instead of starting it twice; a failed attempt is final and
the next ``post`` makes a new one (stages are idempotent, so it resumes from the last commit). The
waiting side (``wait``) returns the done marker's result, or raises ``StageFailed`` with the worker's
error. A stage that a preempted trainer abandoned is released (SIGTERM) or its lease expires (kill -9),
and the next trainer claims it; a trainer that restarts under the same name releases its own leases
first (``WorkQueue.release_stale``).
"""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from spotlight.pool import WAITING, pacer, pool_broken, post_notice, saw_settled
from spotlight.store import AlreadyExistsError, RunStore, StoreError, json_bytes
from spotlight.work_queue import WorkQueue

STAGE_PREFIX = "stages"
TRAINER_STAGES = ("pretrain", "evaluate", "ranking", "update")  # the order a trainer takes open requests in
_REQUEST = re.compile(r"([a-z]+)-(\d{4})-a(\d{2})")
BROKEN_EVERY = 15.0  # seconds between two reads of the pool's broken marker (and the failure) while waiting
QUIET_EVENTS = frozenset({"published", "claimed", "units", "done"})  # changes that cannot be a failure
#: per run store URL: the worker that completed the last stage this process waited on. The next stage is
#: posted for it (it is idle, and it has the run's weights in memory); the other trainers leave that post
#: alone for DESIGNATED_SECONDS (``spotlight.worker``), so they do not pay to read and race for every post.
_LAST_DONE_BY: dict[str, str] = {}


class StageFailed(RuntimeError):
    """A posted stage's attempt failed on a worker (or the pool could not keep one alive)."""

    def __init__(self, message: str, record: dict[str, Any]):
        super().__init__(message)
        self.record = record


@dataclass
class StageRequest:
    """One attempt of one stage of one iteration, as posted on the run store."""

    store: RunStore
    stage: str
    iteration: int
    attempt: int
    lease_seconds: float = 60.0
    _queue: WorkQueue | None = field(default=None, repr=False, compare=False)

    @property
    def prefix(self) -> str:
        return f"{STAGE_PREFIX}/{self.name}"

    @property
    def name(self) -> str:
        return f"{self.stage}-{self.iteration:04d}-a{self.attempt:02d}"

    @property
    def item_id(self) -> str:
        return f"{self.stage}-{self.iteration:04d}"

    @property
    def item(self) -> dict[str, Any]:
        return {"id": self.item_id, "units": [self.item_id], "stage": self.stage, "iteration": self.iteration,
                "attempt": self.attempt}

    def queue(self) -> WorkQueue:
        """The attempt's one-item queue (the same object each time: it remembers what it last saw)."""
        if self._queue is None:
            self._queue = WorkQueue(self.store, self.prefix, lease_seconds=self.lease_seconds)
        self._queue.lease_seconds = self.lease_seconds
        return self._queue

    def done(self) -> dict[str, Any] | None:
        """The done marker (worker, epoch, results), once a worker completed the stage: from the completion
        signal the waiter's look read, else one GET."""
        return self.queue().done_marker(self.item_id)

    def failure(self) -> dict[str, Any] | None:
        try:
            return self.store.get_json(f"{self.prefix}/failed.json")
        except StoreError:
            return None

    def fail(self, worker: str, error: BaseException, **extra: Any) -> dict[str, Any]:
        """Record why this attempt failed (create-only: the first failure is the attempt's). The waiting
        task raises it; trainers take no failed attempt again."""
        tail = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-4000:]
        record = {"stage": self.stage, "iteration": self.iteration, "attempt": self.attempt, "worker": worker,
                  "error": f"{type(error).__name__}: {error}", "traceback_tail": tail, "at": time.time(), **extra}
        try:
            self.store.create_bytes(f"{self.prefix}/failed.json", json_bytes(record))
        except AlreadyExistsError:
            return record
        self.queue().mark_changed()
        return record


def attempts(store: RunStore, stage: str, t: int) -> list[int]:
    head = f"{stage}-{t:04d}-a"
    return sorted(int(n[len(head):]) for n in store.list(STAGE_PREFIX) if n.startswith(head) and n[len(head):].isdigit())


def post(store: RunStore, stage: str, t: int, lease_seconds: float) -> StageRequest:
    """Post a stage (idempotent): the newest attempt if it has not failed, else a new attempt."""
    if stage not in TRAINER_STAGES:
        raise ValueError(f"stage {stage!r} is not trainer work; trainer stages: {', '.join(TRAINER_STAGES)}")
    tried = attempts(store, stage, t)
    if tried:
        newest = StageRequest(store, stage, t, tried[-1], lease_seconds)
        if newest.failure() is None and newest.queue().published():
            return newest
    request = StageRequest(store, stage, t, (tried[-1] + 1) if tried else 1, lease_seconds)
    request.queue().publish([request.item])
    post_notice(store, f"posted {request.name}", kind="stage", name=request.name,
                designated=_LAST_DONE_BY.get(store.url))
    return request


def request_named(store: RunStore, name: str) -> StageRequest | None:
    """The posted attempt a board notice or a listing names (None: not a stage attempt's name)."""
    m = _REQUEST.fullmatch(name)
    return None if m is None else StageRequest(store, m.group(1), int(m.group(2)), int(m.group(3)))


def wait(request: StageRequest, poll_seconds: float | None = None,
         on_poll: Callable[[], None] | None = None, timeout_seconds: float | None = None) -> dict[str, Any]:
    """Wait for the stage's done marker and return it; raise StageFailed with the worker's error if the
    attempt failed, or with the pool's reason if a worker could not be kept alive (``on_poll``, called
    each look, may raise too; ``timeout_seconds``: TimeoutError after that long).

    A look is one GET of the attempt's ``progress.json`` (:meth:`WorkQueue.look`); the done marker is read
    once the look finds the item done, the failure when a change may be one (a failure, a hand-back, or
    every ``BROKEN_EVERY`` seconds); paced by :class:`spotlight.pool.Pacer` (``poll_seconds``: flat
    instead), as is the pool's broken marker."""
    queue, pace = request.queue(), pacer(request.store, poll_seconds)
    deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
    checked_at = time.monotonic()  # the failure and the broken marker: read every BROKEN_EVERY seconds
    with WAITING.waiting():
        if queue.just_published:  # posted just now by this process: nothing can be done yet
            time.sleep(pace.next())
        while True:
            changed, drained = queue.look()
            if changed:
                pace.reset()
            if drained and (done := request.done()) is not None:
                _LAST_DONE_BY[request.store.url] = done["worker"]
                saw_settled(request.store, request.name, (done["results"].get(request.item_id) or {}).get("commit"))
                return done
            full = time.monotonic() - checked_at >= BROKEN_EVERY
            if (changed and queue.last_event not in QUIET_EVENTS) or full:
                failed = request.failure()
                if failed is not None:
                    saw_settled(request.store, request.name)  # the next post tells the trainers
                    raise StageFailed(f"{request.stage} of iteration {request.iteration} (attempt {request.attempt}) "
                                      f"failed on worker {failed['worker']}: {failed['error']}\n"
                                      f"--- the worker's traceback (tail) ---\n{failed['traceback_tail'].rstrip()}",
                                      failed)
                if changed and queue.last_event == "released":  # a preempted trainer handed it back: tell the others
                    post_notice(request.store, f"{request.name} handed back", kind="freed", name=request.name)
            if full:
                checked_at = time.monotonic()
            broken = pool_broken(request.store, read=full)  # this process's own pool: every look, at no cost
            if broken is not None:
                raise StageFailed(f"{request.stage} of iteration {request.iteration} cannot run: the worker pool "
                                  f"is broken: {broken['reason']}", broken)
            if on_poll is not None:
                on_poll()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{request.name} not done within {timeout_seconds:g} s")
            time.sleep(pace.next())


def open_requests(store: RunStore, final: set[str] | None = None,
                  known: dict[str, StageRequest] | None = None) -> list[StageRequest]:
    """Posted attempts that are neither done nor failed, in the order trainers take them. ``final``
    caches the names found done or failed (they never reopen), so a long run's history is read once;
    ``known`` the requests already seen (their queues remember what they last saw: an unchanged one is
    one HEAD)."""
    final = set() if final is None else final
    known = {} if known is None else known
    out = []
    for name in store.list(STAGE_PREFIX):
        if name in final or (fresh := request_named(store, name)) is None:
            continue
        request = known.setdefault(name, fresh)
        if not request.queue().published():
            continue
        if settled(request):
            final.add(name)
            known.pop(name, None)
            continue
        out.append(request)
    order = {s: i for i, s in enumerate(TRAINER_STAGES)}
    return sorted(out, key=lambda r: (r.iteration, order.get(r.stage, 99), r.attempt))


def settled(request: StageRequest) -> bool:
    """Done or failed (never to reopen): one GET while the attempt's queue does not change."""
    queue = request.queue()
    changed, drained = queue.look()
    return drained or (changed and queue.last_event not in QUIET_EVENTS and request.failure() is not None)
