"""Exploration workers: pull items from a WorkQueue until it is drained, surviving preemption.

A worker claims an item, computes its pending units in batches, records each batch as soon as it is
finished and keeps its lease alive from a heartbeat thread. On SIGTERM (a spot preemption notice) it
finishes the unit in hand, records what it finished, releases the item and returns; killed with -9,
it loses only its unrecorded units and its item returns to the queue when the lease expires.
"""

from __future__ import annotations

import contextlib
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


def term_with_parent() -> None:
    """Linux: SIGTERM this process when its parent dies (even by kill -9), so no worker is orphaned; on
    SIGTERM a worker records what it finished and releases its item."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


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


class Preempted(BaseException):
    """SIGTERM (a preemption notice) arrived while a trainer stage ran: the stage is abandoned, its
    item released, and the worker exits. A BaseException, so no stage code swallows it."""


class _Signals:
    """SIGTERM sets ``stop``; while a trainer stage runs (``abortable``) it also raises Preempted into it.

    Why abandon the stage instead of finishing it: a stage is one commit (an update, an evaluation), so
    there is nothing partial to save, the notice may be shorter than the stage, and the next trainer
    (or this one, recovered under the same name) can claim the released item at once. What is finished
    stays committed: pretraining's chunks, and every stage committed before."""

    def __init__(self, stop: threading.Event):
        self.stop, self.armed = stop, False

    def handle(self, signum: int, frame: Any) -> None:
        self.stop.set()
        if self.armed:
            self.armed = False
            raise Preempted(f"signal {signum}")

    @contextlib.contextmanager
    def abortable(self) -> Iterator[None]:
        self.armed = True
        try:
            if self.stop.is_set():
                raise Preempted("stopping")
            yield
        finally:
            self.armed = False


def _process_start_time() -> float:
    """When this process started (Linux: /proc), so a worker's boot (imports, run opened) is paid for."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


class _Ledger:
    """This worker's cost entries: each attempt with the idle time (held, waiting) that preceded it."""

    def __init__(self, run: Any, worker: str, kind: str, slot: str | None):
        from spotlight import cost

        self.cost, self.run, self.worker, self.kind, self.slot = cost, run, worker, kind, slot
        self.idle_from = time.time()

    def idle(self) -> float:
        return max(0.0, time.time() - self.idle_from)

    def record(self, stage: str, iteration: int | None, seconds: float, outcome: str, idle_seconds: float,
               **extra: Any) -> None:
        try:
            where = self.cost.worker_instance(self.run.store, self.kind,
                                              getattr(self.run.cfg.placement, self.kind).price_per_hour, self.slot)
            self.cost.record(self.run.store, stage, iteration, max(seconds, 0.0), where["price_per_hour"],
                             f"{self.worker} on {where['instance']}", worker=self.worker, kind=self.kind,
                             instance=where["instance"], price_source=where["price_source"], outcome=outcome,
                             idle_seconds=idle_seconds, **extra)
        except Exception as e:  # noqa: BLE001 - a ledger write must never turn into a lost stage
            log.warning("cost entry for %s %s not written: %s", stage, iteration, e)
        self.idle_from = time.time()


def _stage_function(stage: str) -> Callable[[Any, int], Any]:
    from spotlight import stages

    return {"pretrain": lambda run, t: stages.pretrain(run), "update": stages.update,
            "evaluate": stages.evaluate, "ranking": stages.ranking_check}[stage]


def _control_group() -> Any:
    """The process group of a trainer launched as several processes (``accelerate launch`` / torchrun on
    a multi-GPU or multi-node trainer): rank 0 pulls the work and tells the other ranks what to run.
    CPU objects go over gloo, CUDA tensors (DDP in the update) over NCCL; accelerate reuses the group."""
    import datetime

    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(hours=12))  # rank 0 may idle long
    return dist


def _follow_rank_0(run: Any, dist: Any, worker_id: str) -> dict[str, Any]:
    """A trainer rank > 0: run the updates rank 0 claims (data-parallel, inside ``stages.update``), until
    rank 0 says the worker is done. Rank 0 alone runs the other stages and writes the store."""
    stats = WorkerStats(f"{worker_id}-rank{dist.get_rank()}")
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            return stats.as_dict()
        stage, t = message[0]
        t0 = time.monotonic()
        try:
            _stage_function(stage)(run, t)
        except Exception as e:  # rank 0 records the failure with the item
            log.warning("rank %d: %s of iteration %d failed: %s", dist.get_rank(), stage, t, e)
        stats.items_claimed += 1
        stats.busy_seconds += time.monotonic() - t0


def work_on_run(run_url: str, worker_id: str | None = None, lease_seconds: float | None = None,
                poll_seconds: float | None = None, idle_exit_seconds: float = 0.0, kind: str = "explorer",
                slot: str | None = None) -> dict[str, Any]:
    """Work on a run as a worker of ``kind`` until the run's flow is over (``pool/done.json``), SIGTERM,
    or nothing to do for ``idle_exit_seconds``.

    ``explorer``: exploration items of every open exploration queue. ``trainer``: the stages the flow
    posts (:mod:`spotlight.stage_queue`: pretrain, update, evaluate, ranking), oldest first, and, when
    there is none, the items of explorations the trainers may join (the flow waits for them). Every
    attempt is written to the cost ledger in a ``finally``. ``lease_seconds`` None: the run's
    ``placement.lease_seconds``; ``poll_seconds`` None: ``stage_queue.default_poll_seconds``. ``slot``: the pool's name for this worker (its instance record)."""
    if kind not in ("explorer", "trainer"):
        raise ValueError(f"worker kind {kind!r}: expected explorer or trainer")
    started = _process_start_time()
    # Imported here: the queue and run_worker stay usable without the model stack (torch, diffusers).
    from spotlight.run import distributed, open_run_from_url

    run = open_run_from_url(run_url)  # a wrong URL fails here, with the run named
    from spotlight import stage_queue
    from spotlight.exploration import explore_units, open_queues, trainers_may_join

    # a store key: SKYPILOT_TASK_ID or a hostname may hold characters the queue does not allow
    worker_id = re.sub(r"[^A-Za-z0-9_=+-]", "-", worker_id or f"{socket.gethostname()}-{os.getpid()}")
    dist = _control_group() if kind == "trainer" and distributed() else None
    if dist is not None and dist.get_rank() != 0:
        return _follow_rank_0(run, dist, worker_id)
    stop = threading.Event()
    signals = _Signals(stop)
    signal.signal(signal.SIGTERM, signals.handle)
    lease = lease_seconds or run.cfg.placement.lease_seconds
    poll_seconds = stage_queue.default_poll_seconds(run.store) if poll_seconds is None else poll_seconds
    ledger = _Ledger(run, worker_id, kind, slot or os.environ.get("SPOTLIGHT_SLOT"))
    # ready: imports done and the run opened (the flow waits for its local workers to get here)
    run.store.put_json(ready_record_key(worker_id), {"worker": worker_id, "kind": kind, "host": socket.gethostname(),
                                                     "pid": os.getpid(), "ready_at": time.time()})
    ledger.record("boot", None, time.time() - started, "ok", 0.0)
    # A previous life of this worker (same name: a SkyPilot recovery, a relaunched process) held leases
    # that nobody will renew: free them now rather than after they expire.
    finals: set[str] = set()
    drained: set[str] = set()
    for request in stage_queue.open_requests(run.store, finals):
        request.queue().release_stale(worker_id)
    for _, queue in open_queues(run, drained):
        queue.release_stale(worker_id)

    def stage_handler(request: stage_queue.StageRequest) -> Handler:
        def handle(item: dict[str, Any], units: list[str]) -> Iterator[tuple[str, Any]]:
            idle, t0, outcome, result = ledger.idle(), time.time(), "failed", None
            try:
                if dist is not None and request.stage == "update":  # every rank trains its share
                    dist.broadcast_object_list([(request.stage, request.iteration)], src=0)
                with signals.abortable():
                    commit = _stage_function(request.stage)(run, request.iteration)
                outcome = "ok"
                result = {"commit": None if commit is None else commit.name, "worker": worker_id,
                          "seconds": time.time() - t0}
            except Preempted:
                outcome = "preempted"
                raise
            except Exception as e:
                request.fail(worker_id, e, seconds=time.time() - t0)
                raise
            finally:
                ledger.record(request.stage, request.iteration if request.stage != "pretrain" else None,
                              time.time() - t0, outcome, idle, attempt=request.attempt)
            return iter([(units[0], result)])
        return handle

    total = WorkerStats(worker_id)
    idle_since = time.monotonic()
    try:
        while not stop.is_set() and not stage_queue.pool_done(run.store):
            worked = False
            if kind == "trainer":
                for request in stage_queue.open_requests(run.store, finals):
                    request.lease_seconds = lease
                    queue = request.queue()
                    claim = queue.claim(worker_id)
                    if claim is None:
                        continue
                    worked, stats = True, WorkerStats(worker_id, items_claimed=1)
                    t0 = time.monotonic()
                    try:
                        _work_item(queue, claim, stage_handler(request), 1, stop, stats)
                    except Preempted:
                        raise
                    except Exception as e:  # recorded with the item: the waiting task raises it
                        log.warning("%s failed on %s: %s", request.name, worker_id, e)
                    finally:
                        stats.busy_seconds = time.monotonic() - t0
                        total.add(stats.as_dict())
                    break  # stages first, in order: look again
            if not worked:
                for t, queue in open_queues(run, drained):
                    if kind == "trainer" and not trainers_may_join(queue):
                        continue
                    queue.lease_seconds = lease
                    idle, t0, stats = ledger.idle(), time.time(), None
                    try:
                        stats = run_worker(queue, functools.partial(explore_units, run, t, role=kind), worker_id=worker_id,
                                           stop=stop, poll_seconds=poll_seconds, idle_exit_seconds=0.0)
                    finally:
                        if stats is None or stats["items_claimed"]:
                            outcome = "failed" if stats is None else \
                                "preempted" if stats["items_released"] else \
                                "lease-lost" if stats["leases_lost"] else "ok"
                            ledger.record("explore", t, stats["busy_seconds"] if stats else time.time() - t0,
                                          outcome, idle, units=stats["units_done"] if stats else None)
                    total.add(stats)
                    if stats["items_claimed"]:
                        worked = True
                        if kind == "trainer":
                            break  # back to the stages first
            if worked:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= idle_exit_seconds:
                break
            else:
                t0 = time.monotonic()
                stop.wait(poll_seconds)
                total.idle_seconds += time.monotonic() - t0
    except Preempted:
        pass  # the stage in hand was released; its attempt is in the ledger
    finally:
        ledger.record("idle", None, 0.0, "exit", ledger.idle())
        if dist is not None:
            dist.broadcast_object_list([None], src=0)  # the other ranks leave too
    total.stopped = stop.is_set()
    return total.as_dict()
