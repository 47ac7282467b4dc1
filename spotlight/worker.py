"""Exploration workers: pull items from a WorkQueue until it is drained, surviving preemption.

A worker claims an item, computes its pending units in batches, records each batch as soon as it is
finished and keeps its lease alive from a heartbeat thread. On SIGTERM (a spot preemption notice) it
finishes the unit in hand, records what it finished, releases the item and returns; killed with -9,
it loses only its unrecorded units and its item returns to the queue when the lease expires.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import signal
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

from spotlight.store import StoreError
from spotlight.work_queue import Claim, LeaseLostError, WorkQueue

Handler = Callable[[dict[str, Any], list[str]], Iterator[tuple[str, Any]]]
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


def install_sigterm_handler(stop: threading.Event) -> None:
    """On SIGTERM set ``stop`` (the worker then records, releases and exits) instead of dying mid-write."""
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())


def run_worker(queue: WorkQueue, handler: Handler, *, worker_id: str, batch_units: int = 1,
               stop: threading.Event | None = None, poll_seconds: float = 0.5,
               idle_exit_seconds: float | None = None) -> dict[str, Any]:
    """Pull items until the queue is drained, ``stop`` is set, or (if idle_exit_seconds is not None)
    nothing was claimable for that long; items leased by others are waited for, since they may expire."""
    if batch_units < 1:
        raise ValueError(f"batch_units must be >= 1, got {batch_units}")
    stop = stop or threading.Event()
    stats = WorkerStats(worker_id)
    idle_since: float | None = None
    while not stop.is_set():
        t0 = time.monotonic()
        claim = queue.claim(worker_id)
        if claim is None:
            if queue.drained():
                break
            idle_since = idle_since if idle_since is not None else t0
            if idle_exit_seconds is not None and time.monotonic() - idle_since >= idle_exit_seconds:
                stats.idle_seconds += time.monotonic() - t0
                break
            stop.wait(poll_seconds)
            stats.idle_seconds += time.monotonic() - t0
            continue
        idle_since = None
        stats.items_claimed += 1
        try:
            _work_item(queue, claim, handler, batch_units, stop, stats)
        finally:
            stats.busy_seconds += time.monotonic() - t0
    stats.stopped = stop.is_set()
    return stats.as_dict()


def _work_item(queue: WorkQueue, claim: Claim, handler: Handler, batch_units: int,
               stop: threading.Event, stats: WorkerStats) -> None:
    lost = threading.Event()
    beat_stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(queue, claim, lost, beat_stop), daemon=True,
                            name=f"lease-{claim.item_id}")
    beat.start()
    finished: dict[str, Any] = {}
    try:
        pending = queue.pending_units(claim.item_id)
        for start in range(0, len(pending), batch_units):
            if stop.is_set() or lost.is_set():
                break
            results = handler(claim.item, pending[start:start + batch_units])
            try:
                for unit, result in results:
                    finished[unit] = result
                    if stop.is_set() or lost.is_set():
                        break  # the unit in hand is finished; the rest of the batch is abandoned
            finally:
                if hasattr(results, "close"):
                    results.close()
            stats.units_done += queue.record(claim, finished)
            finished = {}
        if lost.is_set():
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
    finally:
        beat_stop.set()
        beat.join()


def _heartbeat(queue: WorkQueue, claim: Claim, lost: threading.Event, beat_stop: threading.Event) -> None:
    """Renew the lease every third of its length, so one slow unit never lets it expire."""
    while not beat_stop.wait(queue.lease_seconds / 3):
        try:
            queue.renew(claim)
        except LeaseLostError:
            lost.set()
            return
        except (StoreError, OSError) as e:  # a store hiccup: try again next beat, the lease has slack
            log.warning("lease renewal of %s failed: %s", claim.item_id, e)


def ready_record_key(worker_id: str) -> str:
    """Where a worker records that it is ready (imports done, run opened): host, pid, time."""
    return f"workers/{worker_id}.json"


def work_on_run(run_url: str, worker_id: str | None = None, lease_seconds: float | None = None,
                poll_seconds: float = 0.5, idle_exit_seconds: float = 0.0) -> dict[str, Any]:
    """Work on a run's exploration queues until none has claimable work for idle_exit_seconds.

    lease_seconds None keeps each queue's own lease (the run's ``exploration.lease_seconds``)."""
    # Imported here: the queue and run_worker stay usable without the model stack (torch, diffusers).
    from spotlight.run import open_run_from_url

    run = open_run_from_url(run_url)  # a wrong URL fails here, with the run named
    from spotlight.exploration import explore_units, open_queues

    # a store key: SKYPILOT_TASK_ID or a hostname may hold characters the queue does not allow
    worker_id = re.sub(r"[^A-Za-z0-9_=+-]", "-", worker_id or f"{socket.gethostname()}-{os.getpid()}")
    # ready: imports done and the run opened (the flow waits for its local workers to get here)
    run.store.put_json(ready_record_key(worker_id), {"worker": worker_id, "host": socket.gethostname(),
                                                     "pid": os.getpid(), "ready_at": time.time()})
    stop = threading.Event()
    install_sigterm_handler(stop)
    total = WorkerStats(worker_id)
    idle_since = time.monotonic()
    while not stop.is_set():
        worked = False
        for t, queue in open_queues(run):
            queue.lease_seconds = lease_seconds or queue.lease_seconds
            stats = run_worker(queue, functools.partial(explore_units, run, t), worker_id=worker_id, stop=stop,
                               poll_seconds=poll_seconds, idle_exit_seconds=0.0)
            total.add(stats)
            worked = worked or stats["items_claimed"] > 0
        if worked:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= idle_exit_seconds:
            break
        else:
            t0 = time.monotonic()
            stop.wait(poll_seconds)
            total.idle_seconds += time.monotonic() - t0
    total.stopped = stop.is_set()
    return total.as_dict()
