"""The queue-worker loop: pull items from a WorkQueue until it is drained, surviving preemption.

A worker claims an item, computes its pending units in batches, records each batch as soon as it is
finished and keeps its lease alive from a heartbeat thread (:class:`LeaseKeeper`). On SIGTERM (a spot
preemption notice) it finishes the unit in hand, records what it finished, releases the item and
returns; killed with -9, it loses only its unrecorded units and its item returns to the queue when the
lease expires.

It needs only the store and the queue (no model stack, no stages): exploration, the run's workers
(:mod:`spotlight.worker`) and the SP group members (:mod:`spotlight.sequence_parallel.member`) build
on it.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from spotlight.store import RunStore, StoreError
from spotlight.work_queue import Claim, LeaseLostError, WorkQueue

#: computes an item's units: (item, units) -> (unit, result) as each unit is finished
Handler = Callable[[dict[str, Any], list[str]], Iterator[tuple[str, Any]]]
#: how a worker that SIGTERM stopped exits (128 + SIGTERM, as a shell reports it): never 0, which SkyPilot's
#: jobs controller reads as SUCCEEDED (no recovery). The task YAMLs list it in ``recover_on_exit_codes``,
#: so SkyPilot recovers the job even when it reads the exit before the preempted VM is gone.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    """What one worker did; utilisation = busy / (busy + idle)."""

    worker: str
    items_claimed: int = 0
    items_completed: list[str] = field(default_factory=list)  # complete() returned True
    items_released: list[str] = field(default_factory=list)   # handed back on stop
    leases_lost: list[str] = field(default_factory=list)      # taken over after an expiry
    units_done: int = 0                                        # units this worker recorded first
    busy_seconds: float = 0.0
    idle_seconds: float = 0.0
    stopped: bool = False                                      # left because stop (SIGTERM) was set

    def as_dict(self) -> dict[str, Any]:
        total = self.busy_seconds + self.idle_seconds
        return {**asdict(self), "utilisation": self.busy_seconds / total if total > 0 else 0.0}

    def add(self, other: dict[str, Any]) -> None:
        for key in ("items_completed", "items_released", "leases_lost"):
            getattr(self, key).extend(other[key])
        for key in ("items_claimed", "units_done", "busy_seconds", "idle_seconds"):
            setattr(self, key, getattr(self, key) + other[key])
        self.stopped = self.stopped or other["stopped"]


def exit_code(run_url: str, stopped: bool) -> int:
    """How a run's worker exits: 0 when the run's flow is over (SIGTERM or not: the pool is done, and SkyPilot
    may record SUCCEEDED), PREEMPTED_EXIT_CODE when SIGTERM stopped it while the run still needs it."""
    from spotlight.pool import pool_done

    return PREEMPTED_EXIT_CODE if stopped and not pool_done(RunStore(run_url)) else 0


def term_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (even by kill -9), so no worker is orphaned; on
    SIGTERM a worker records what it finished and releases its item."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def install_sigterm_handler(stop: threading.Event) -> None:
    """On SIGTERM set ``stop`` (the worker then records, releases and exits) instead of dying mid-write."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())


class LeaseKeeper:
    """Renews a claim's lease from a daemon thread every third of its length, so one slow unit never lets
    it expire. ``lost`` is set once the lease was taken over (it had expired): the new holder finishes
    the item. Use as a context manager, or ``start()`` ... ``stop()`` when the claim outlives a call."""

    def __init__(self, queue: WorkQueue, claim: Claim):
        self.queue, self.claim = queue, claim
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True, name=f"lease-{claim.item_id}")

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> LeaseKeeper:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _beat(self) -> None:
        while not self._stop.wait(self.queue.lease_seconds / 3):
            try:
                self.queue.renew(self.claim)
            except LeaseLostError:
                self.lost.set()
                return
            except (StoreError, OSError) as e:  # a store hiccup: try again next beat, the lease has slack
                log.warning("lease renewal of %s failed: %s", self.claim.item_id, e)


def run_worker(queue: WorkQueue, handler: Handler, *, worker_id: str, batch_units: int = 1,
               stop: threading.Event | None = None, poll_seconds: float = 0.5,
               idle_exit_seconds: float | None = None) -> dict[str, Any]:
    """Pull items until the queue is drained, ``stop`` is set, or (if idle_exit_seconds is not None)
    nothing was claimable for that long; items leased by others are waited for, since they may expire.
    Returns :class:`WorkerStats` as a dict."""
    if batch_units < 1:
        raise ValueError(f"batch_units must be >= 1, got {batch_units}")
    stop = stop or threading.Event()
    stats = WorkerStats(worker_id)
    idle_since: float | None = None
    while not stop.is_set():
        t0 = time.monotonic()
        claim = queue.claim(worker_id)
        if claim is None:
            idle_since = idle_since if idle_since is not None else t0
            if idle_exit_seconds is not None and time.monotonic() - idle_since >= idle_exit_seconds:
                stats.idle_seconds += time.monotonic() - t0
                break
            if queue.drained():
                break
            stop.wait(poll_seconds)
            stats.idle_seconds += time.monotonic() - t0
            continue
        idle_since = None
        stats.items_claimed += 1
        try:
            work_item(queue, claim, handler, batch_units, stop, stats)
        finally:
            stats.busy_seconds += time.monotonic() - t0
    stats.stopped = stop.is_set()
    return stats.as_dict()


def work_item(queue: WorkQueue, claim: Claim, handler: Handler, batch_units: int,
              stop: threading.Event, stats: WorkerStats) -> None:
    """Compute a claimed item's pending units, recording each batch, then complete it; on ``stop`` release
    it (what is finished stays recorded); a lost lease leaves it to its new holder. ``stats`` is updated."""
    with LeaseKeeper(queue, claim) as lease:
        finished: dict[str, Any] = {}
        try:
            pending = queue.pending_units(claim.item_id)
            for start in range(0, len(pending), batch_units):
                if stop.is_set() or lease.lost.is_set():
                    break
                results = handler(claim.item, pending[start:start + batch_units])
                try:
                    for unit, result in results:
                        finished[unit] = result
                        if stop.is_set() or lease.lost.is_set():
                            break  # the unit in hand is finished; the rest of the batch is abandoned
                finally:
                    if hasattr(results, "close"):
                        results.close()
                stats.units_done += queue.record(claim, finished)
                finished = {}
            if lease.lost.is_set():
                stats.leases_lost.append(claim.item_id)  # the new holder finishes it
            elif stop.is_set() and queue.pending_units(claim.item_id):
                queue.release(claim)
                stats.items_released.append(claim.item_id)
            elif queue.complete(claim):
                stats.items_completed.append(claim.item_id)
        except BaseException:
            # A failing handler or store: keep what is finished, hand the item back, then fail loudly
            # with the original error (the lease expiry covers a store that cannot take the release).
            try:
                stats.units_done += queue.record(claim, finished)
                queue.release(claim)
                stats.items_released.append(claim.item_id)
            except Exception as e:
                log.warning("could not record/release %s after a failure: %s", claim.item_id, e)
            raise
