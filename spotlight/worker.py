"""The run's long-lived workers (``spotlight worker --kind trainer|explorer``): work on a run until its flow is over.

A trainer takes the stages the flow posts (:mod:`spotlight.stage_queue`: pretrain, update, evaluate,
ranking), oldest first, and, when none is open, the items of explorations the trainers may join. An
explorer takes the items of every open exploration queue (:mod:`spotlight.exploration`). Both pull
through the queue-worker loop (:mod:`spotlight.queue_worker`: leases, SIGTERM, kill -9) and write every
attempt to the cost ledger (:class:`spotlight.cost.Ledger`) with how it ended
(:class:`spotlight.cost.Outcome`).

Layering: the queue (``work_queue``, ``queue_worker``, ``pool``, ``stage_queue``) and the ledger
(``cost``) sit below the stages; this module sits on top of them all, and nothing in the library
imports it back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import signal
import socket
import threading
import time
from types import ModuleType
from typing import Any, Callable, Iterator

from spotlight import stages
from spotlight.cost import Ledger, Outcome, process_start_time
from spotlight.exploration import explore_units, open_queues, queue_named, trainers_may_join
from spotlight.pool import BoardReader, Pacer, poll_range, pool_done, ready_record_key
from spotlight.queue_worker import Handler, WorkerStats, run_worker, work_item
from spotlight.config import ConfigError
from spotlight.mounts import bucket_url, input_paths
from spotlight.run import Run, check_inputs, distributed, open_run_from_url
from spotlight.stage_queue import TRAINER_STAGES, StageRequest, open_requests, request_named
from spotlight.store import Commit, counting_requests
from spotlight.work_queue import WorkQueue

log = logging.getLogger(__name__)
LIST_AT_LEAST_EVERY = 60.0  # seconds: an idle worker lists the posted work this often even if the board is quiet
#: in looks (shortest pauses, :func:`spotlight.pool.poll_range`): how long a trainer leaves a stage posted for
#: another trainer (the one that finished the flow's last stage) before it tries it; and the least time
#: between two tries of an item that another worker holds (a hand-back is on the board at once; this is
#: for a holder that died without one: its lease expires)
DESIGNATED_LOOKS, HELD_LOOKS = 3, 15

#: what a trainer runs for each stage it takes from the stage queue
STAGE_FUNCTIONS: dict[str, Callable[[Run, int], Commit | None]] = {
    "pretrain": lambda run, t: stages.pretrain(run), "update": stages.update, "evaluate": stages.evaluate,
    "ranking": stages.ranking_check,
}


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


def _control_group() -> ModuleType:
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


def _follow_rank_0(run: Run, dist: ModuleType, worker_id: str) -> dict[str, Any]:
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
            STAGE_FUNCTIONS[stage](run, t)
        except Exception as e:  # rank 0 records the failure with the item
            log.warning("rank %d: %s of iteration %d failed: %s", dist.get_rank(), stage, t, e)
        stats.items_claimed += 1
        stats.busy_seconds += time.monotonic() - t0


def check_worker_inputs(cfg: Any) -> None:
    """The inputs as this worker sees them (a cloud worker: through its mounts), before it takes work: a
    missing or wrong one fails here, naming the path and the bucket mounted there."""
    try:
        check_inputs(cfg)
    except ConfigError as e:
        mounted = {path: url for path in input_paths(cfg).values() if (url := bucket_url(cfg, path))}
        raise ConfigError(f"{e}" + "".join(f"\n({path} is {url}, mounted by placement.mounts)"
                                           for path, url in mounted.items() if path in str(e))) from None


def _pull_outcome(stats: dict[str, Any] | None) -> Outcome:
    """How a pull of an exploration queue ended (``stats``: :func:`run_worker`'s, None if it raised)."""
    if stats is None:
        return Outcome.FAILED
    if stats["items_released"]:
        return Outcome.PREEMPTED
    if stats["leases_lost"]:
        return Outcome.LEASE_LOST
    return Outcome.OK


class _Worker:
    """One worker process working on a run: what it takes next, and how each attempt is paid for."""

    def __init__(self, run: Run, worker_id: str, kind: str, signals: _Signals, ledger: Ledger, lease_seconds: float,
                 poll: tuple[float, float], dist: ModuleType | None):
        self.run, self.worker_id, self.kind, self.signals, self.ledger = run, worker_id, kind, signals, ledger
        self.stop = signals.stop
        self.lease_seconds, (self.poll_seconds, self.poll_high) = lease_seconds, poll
        self.dist = dist  # a multi-process trainer's rank 0 tells the other ranks what to run
        self.total = WorkerStats(worker_id)
        self.finals: set[str] = set()   # stage attempts seen done or failed (they never reopen)
        self.drained: set[str] = set()  # exploration queues seen drained (they never reopen)
        # What was posted, as the board's notices (or, when they cannot be followed, a listing) tell it: an
        # idle look is one GET of the board, whatever the queues' sizes and however many are open.
        self.known_requests: dict[str, StageRequest] = {}
        self.known_queues: dict[str, WorkQueue] = {}
        self.requests: list[StageRequest] = []
        self.explorations: list[tuple[int, WorkQueue]] = []
        self.board = BoardReader(run.store)
        self.listed_at, self.over = -math.inf, False
        # monotonic time before which a stage or queue is not tried (posted for another trainer; every item
        # held by others or done): a try costs a few requests, and nothing changes before then unless a
        # notice says so (an item handed back)
        self.not_before: dict[str, float] = {}

    def release_stale(self) -> None:
        """A previous life of this worker (same name: a SkyPilot recovery, a relaunched process) held leases
        that nobody will renew: free them now rather than after they expire."""
        for request in open_requests(self.run.store, self.finals, self.known_requests):
            request.queue().release_stale(self.worker_id)
        for _, queue in open_queues(self.run, self.drained, self.known_queues):
            queue.release_stale(self.worker_id)

    def _list_work(self) -> None:
        """What the flow has posted: the board's new notices (one GET), applied; the run's stages and queues
        are listed only when the notices cannot be followed (the first look, a restarted flow, a pool
        change, a reader too far behind) and once a minute (a safety net)."""
        news = self.board.read()
        if news is None or time.monotonic() - self.listed_at >= LIST_AT_LEAST_EVERY:
            self.listed_at = time.monotonic()
            self.over = pool_done(self.run.store)
            self.requests = open_requests(self.run.store, self.finals, self.known_requests) if self.kind == "trainer" else []
            self.explorations = [(t, q) for t, q in open_queues(self.run, self.drained, self.known_queues)
                                 if self.kind == "explorer" or trainers_may_join(q)]
            return
        for notice in news:
            self._apply(notice)

    def _apply(self, notice: dict[str, Any]) -> None:
        """One board notice: what settled is dropped unread; a posted stage (a trainer's), a published
        exploration (an explorer's) or one the trainers may join (a trainer's) is added; an item handed
        back is tried again at once."""
        for name in notice.get("settled", ()):
            self._settle(name)
        kind, name = notice.get("kind"), notice.get("name") or notice.get("prefix")
        if kind == "freed":
            self.not_before.pop(name, None)
        elif kind == "stage" and self.kind == "trainer" and name not in self.finals and name not in self.known_requests:
            if (request := request_named(self.run.store, name)) is not None:
                self.known_requests[name] = request
                self.requests.append(request)
                order = {s: i for i, s in enumerate(TRAINER_STAGES)}
                self.requests.sort(key=lambda r: (r.iteration, order.get(r.stage, 99), r.attempt))
                if notice.get("designated") not in (None, self.worker_id):
                    self.not_before[name] = time.monotonic() + DESIGNATED_LOOKS * self.poll_seconds
        elif (kind == "exploration" and self.kind == "explorer") or (kind == "join" and self.kind == "trainer"):
            found = queue_named(self.run, name)
            queue_name = name.rpartition("/")[2]
            if found is not None and queue_name not in self.drained and queue_name not in self.known_queues:
                self.known_queues[queue_name] = found[1]
                self.explorations = sorted([*self.explorations, found], key=lambda tq: tq[0])

    def _settle(self, name: str) -> None:
        """A stage attempt (its name) done or failed, or an exploration queue (its prefix) drained: neither
        reopens, so it is never tried again."""
        if "/" in name:
            queue_name = name.rpartition("/")[2]
            self.drained.add(queue_name)
            self.known_queues.pop(queue_name, None)
            self.explorations = [(t, q) for t, q in self.explorations if q.prefix != name]
        else:
            self.finals.add(name)
            self.known_requests.pop(name, None)
            self.requests = [r for r in self.requests if r.name != name]
        self.not_before.pop(name, None)

    def _hold_off(self, name: str, queue: WorkQueue) -> None:
        """A try found nothing to take in ``queue``: leave it until a lease it saw may expire (and at least
        HELD_LOOKS looks), or until a notice says an item was handed back."""
        self.not_before[name] = time.monotonic() + max(queue.held_until() - queue.clock(), HELD_LOOKS * self.poll_seconds)

    def _may_try(self, name: str) -> bool:
        return time.monotonic() >= self.not_before.get(name, -math.inf)

    def work(self, idle_exit_seconds: float) -> dict[str, Any]:
        """Take work until the run's flow is over, SIGTERM, or nothing to take for ``idle_exit_seconds``.

        Each round: a trainer takes a posted stage first, else (either kind) exploration items; with
        nothing to take, it waits (a tenth of the time it has waited, up to a few seconds on S3:
        :class:`spotlight.pool.Pacer`). The idle tail is the worker's last ledger entry."""
        idle_since, pace = time.monotonic(), Pacer(self.poll_seconds, max(self.poll_seconds, self.poll_high))
        try:
            while not self.stop.is_set():
                looked = time.monotonic()
                with counting_requests() as sent:  # this thread's: not the lease renewals beside it
                    self._list_work()
                    if self.over:
                        break
                    worked = (self.kind == "trainer" and self._take_stage()) or self._take_exploration()
                    if worked:
                        idle_since = time.monotonic()
                        pace.reset()
                        continue
                    if time.monotonic() - idle_since >= idle_exit_seconds:
                        break
                    t0 = time.monotonic()
                    self.stop.wait(pace.next())
                    self.total.idle_seconds += time.monotonic() - t0
                    self.ledger.waited(time.monotonic() - looked, sent())
        except Preempted:
            pass  # the stage in hand was released; its attempt is in the ledger
        finally:
            self.ledger.record("idle", None, 0.0, Outcome.EXIT, self.ledger.idle())
            if self.dist is not None:
                self.dist.broadcast_object_list([None], src=0)  # the other ranks leave too
        self.total.stopped = self.stop.is_set()
        return self.total.as_dict()

    # -- a posted stage ----------------------------------------------------------------------------
    def _take_stage(self) -> bool:
        """Run one posted trainer stage; whether there was one to claim.

        1. Claim the first open stage attempt, in the order trainers take them (oldest iteration first).
        2. Work on it as a one-unit item: the lease is kept alive, and SIGTERM abandons the stage
           (Preempted) and releases the item.
        3. The attempt is in the ledger however it ended. A failure is recorded with the attempt (the
           flow's waiting task raises it) and the worker goes on; Preempted goes up: the worker exits.
        """
        for request in self.requests:
            if not self._may_try(request.name):
                continue
            request.lease_seconds = self.lease_seconds
            queue = request.queue()
            claim = queue.claim(self.worker_id)
            if claim is not None:
                self.not_before.pop(request.name, None)
                break
            self._hold_off(request.name, queue)
        else:
            return False
        stats, t0 = WorkerStats(self.worker_id, items_claimed=1), time.monotonic()
        try:
            work_item(queue, claim, self._stage_handler(request), 1, self.stop, stats)
        except Preempted:
            raise
        except Exception as e:  # recorded with the item: the waiting task raises it
            log.warning("%s failed on %s: %s", request.name, self.worker_id, e)
        finally:
            stats.busy_seconds = time.monotonic() - t0
            self.total.add(stats.as_dict())
        if not stats.leases_lost:  # done or failed: final (a lost lease is its new holder's to finish)
            self._settle(request.name)
        return True

    def _stage_handler(self, request: StageRequest) -> Handler:
        """The stage attempt's one unit, as the queue-worker loop computes it."""
        def handle(item: dict[str, Any], units: list[str]) -> Iterator[tuple[str, Any]]:
            return iter([(units[0], self._attempt_stage(request))])
        return handle

    def _attempt_stage(self, request: StageRequest) -> dict[str, Any]:
        """Run the attempt's stage (its function commits the step) and return the done marker's result. The
        attempt's ledger entry is written before its outcome is visible (the done marker, the failure), so
        whoever sees the outcome sees the bill."""
        idle, t0, outcome = self.ledger.idle(), time.time(), Outcome.FAILED

        def bill() -> None:
            self.ledger.record(request.stage, None if request.stage == "pretrain" else request.iteration,
                               time.time() - t0, outcome, idle, attempt=request.attempt)
        try:
            if self.dist is not None and request.stage == "update":  # every rank trains its share
                self.dist.broadcast_object_list([(request.stage, request.iteration)], src=0)
            with self.signals.abortable():
                commit = STAGE_FUNCTIONS[request.stage](self.run, request.iteration)
            outcome = Outcome.OK
            bill()
            return {"commit": None if commit is None else commit.name, "worker": self.worker_id,
                    "seconds": time.time() - t0}
        except Preempted:
            outcome = Outcome.PREEMPTED
            bill()
            raise
        except Exception as e:
            seconds = time.time() - t0
            bill()
            request.fail(self.worker_id, e, seconds=seconds)
            raise

    # -- exploration items ---------------------------------------------------------------------------
    def _take_exploration(self) -> bool:
        """Explore open explorations' items; whether any was claimed.

        1. Go through the open exploration queues, oldest first (a trainer: only those the trainers may
           join).
        2. Pull each with the queue-worker loop until none of its items is claimable (others' leases are
           not waited for: they are the flow's to wait on).
        3. Each pull that claimed an item (or raised) is one ledger entry.
        4. A trainer goes back to the stages after the first queue it explored in.
        """
        worked = False
        for t, queue in self.explorations:
            if not self._may_try(queue.prefix):
                continue
            claimed = self._pull(t, queue)["items_claimed"]
            self._hold_off(queue.prefix, queue)  # the pull ended with nothing left to claim
            if claimed:
                worked = True
                if self.kind == "trainer":
                    break  # back to the stages first
        return worked

    def _pull(self, t: int, queue: WorkQueue) -> dict[str, Any]:
        """Explore iteration t's queue until nothing in it is claimable; its stats."""
        queue.lease_seconds = self.lease_seconds
        idle, t0, stats = self.ledger.idle(), time.time(), None
        try:
            stats = run_worker(queue, functools.partial(explore_units, self.run, t, role=self.kind),
                               worker_id=self.worker_id, stop=self.stop, poll_seconds=self.poll_seconds,
                               idle_exit_seconds=0.0)
        finally:
            if stats is None or stats["items_claimed"]:
                self.ledger.record("explore", t, time.time() - t0 if stats is None else stats["busy_seconds"],
                                   _pull_outcome(stats), idle, units=None if stats is None else stats["units_done"])
        self.total.add(stats)
        return stats


def work_on_run(run_url: str, worker_id: str | None = None, lease_seconds: float | None = None,
                poll_seconds: float | None = None, idle_exit_seconds: float = 0.0, kind: str = "explorer",
                slot: str | None = None) -> dict[str, Any]:
    """Work on a run as a worker of ``kind`` until the run's flow is over (``pool/done.json``), SIGTERM,
    or nothing to do for ``idle_exit_seconds``; returns the worker's stats.

    ``explorer``: exploration items of every open exploration queue. ``trainer``: the stages the flow
    posts, oldest first, and, when there is none, the items of explorations the trainers may join (the
    flow waits for them). ``lease_seconds`` None: the run's ``placement.lease_seconds``; ``poll_seconds``
    None: the store's ``pool.poll_range`` (a flat ``poll_seconds`` otherwise). ``slot``: the pool's name
    for this worker (its instance record).

    1. Open the run (a wrong URL fails here, naming it); a multi-process trainer's ranks > 0 follow rank 0.
    2. Handle SIGTERM, write the ready record and the boot's ledger entry, free a previous life's leases.
    3. Take work (:meth:`_Worker.work`).
    """
    if kind not in ("explorer", "trainer"):
        raise ValueError(f"worker kind {kind!r}: expected explorer or trainer")
    started = process_start_time()
    # SkyPilot ran the task's setup (pip install ...) before this process: sky/*.yaml note when it began
    setup_started = min(float(os.environ.get("SPOTLIGHT_SETUP_STARTED_AT") or started), started)
    run = open_run_from_url(run_url)
    check_worker_inputs(run.cfg)
    # a store key: SKYPILOT_TASK_ID or a hostname may hold characters the queue does not allow
    worker_id = re.sub(r"[^A-Za-z0-9_=+-]", "-", worker_id or f"{socket.gethostname()}-{os.getpid()}")
    dist = _control_group() if kind == "trainer" and distributed() else None
    if dist is not None and dist.get_rank() != 0:
        return _follow_rank_0(run, dist, worker_id)
    signals = _Signals(threading.Event())
    signal.signal(signal.SIGTERM, signals.handle)
    ledger = Ledger(run.store, worker_id, kind, getattr(run.cfg.placement, kind).price_per_hour,
                    slot or os.environ.get("SPOTLIGHT_SLOT"))
    worker = _Worker(run, worker_id, kind, signals, ledger, lease_seconds or run.cfg.placement.lease_seconds,
                     poll_range(run.store) if poll_seconds is None else (poll_seconds, poll_seconds), dist)
    # ready: imports done and the run opened (the flow waits for its local workers to get here)
    run.store.put_json(ready_record_key(worker_id), {"worker": worker_id, "kind": kind, "host": socket.gethostname(),
                                                     "pid": os.getpid(), "ready_at": time.time()})
    ledger.record("boot", None, time.time() - setup_started, Outcome.OK, 0.0, setup_seconds=started - setup_started)
    worker.release_stale()
    return worker.work(idle_exit_seconds)
