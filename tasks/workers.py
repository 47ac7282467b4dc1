"""The run's worker pool for the duration of a flow: long-lived trainers and explorers.

Embedded default: ``spotlight worker`` processes on this machine (``LocalPool``). Cloud
(``SPOTLIGHT_LAUNCHER=sky``): the same command as SkyPilot managed jobs, one per worker, with the
resources of the run's placement (``SkyPool``, through ``tasks.launcher.SkyLauncher``). Either way a
keeper thread holds the pool at its configured size while the flow runs: a worker whose process or
job ended is started again (a preemption in the cloud is SkyPilot's recovery of the same job, not a
new launch), and after ``placement.max_relaunches`` failures the pool is marked broken in the store,
so every waiting stage fails naming the worker and why instead of waiting forever.

The pool also pays the controller's bills into the run's ledger (:class:`ControllerMeter`): the VM the
flow runs on and the S3 requests of the flow's process; and, for SkyPilot jobs, the time SkyPilot spent
provisioning each worker (from the job's own record).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from spotlight.config import Config, load_config
from spotlight.cost import Ledger, Outcome, PriceError, process_start_time, record_provisioning, resources_price
from spotlight.pool import (WAITING, mark_pool_broken, mark_pool_done, pool_broken, pool_done, ready_record_key,
                            reset_pool, write_slot)
from spotlight.queue_worker import PREEMPTED_EXIT_CODE, term_with_parent
from spotlight.store import RunStore
from tasks.launcher import SkyLauncher, job_status, launcher_from_env, run_prefix

CONTROLLER = "controller"  # the controller's slot and worker name in the ledger

log = logging.getLogger(__name__)
# a local worker's exit codes that are not its failure: done, preempted (it committed and left), SIGTERM'd
NOT_A_FAILURE = (0, PREEMPTED_EXIT_CODE, -signal.SIGTERM)


def worker_slots(cfg: Config) -> list[tuple[str, int]]:
    """(kind, index) of every worker the run wants: trainers always, explorers unless mode ``none``."""
    explorers = cfg.placement.explorer.workers if cfg.exploration.mode != "none" else 0
    return [("trainer", i) for i in range(cfg.placement.trainer.workers)] + [("explorer", i) for i in range(explorers)]


@contextmanager
def worker_pool(cfg: Config, launcher: Any = None) -> Iterator["LocalPool | SkyPool"]:
    """Start the run's workers, keep them while the flow runs, then tell them the run is over. If the flow
    body raises (a failed stage, the flow timeout, SIGTERM), the workers are stopped at once: cloud jobs are
    cancelled without the grace a finished flow gives them to leave by themselves."""
    launcher = launcher if launcher is not None else launcher_from_env()
    pool: LocalPool | SkyPool = SkyPool(cfg, launcher) if isinstance(launcher, SkyLauncher) else LocalPool(cfg)
    reset_pool(pool.store)
    meter = ControllerMeter(pool.store, pool.controller_instance())
    stop = threading.Event()
    keeper = threading.Thread(target=_keep, args=(pool, meter, stop), name="worker-pool", daemon=True)
    why = "the flow is over"
    try:
        pool.start()
        keeper.start()
        yield pool
    except BaseException as e:
        why = f"the flow stopped: {type(e).__name__}: {e}"
        raise
    finally:
        stop.set()
        if keeper.is_alive():
            keeper.join()
        mark_pool_done(pool.store, why)
        pool.close(grace=why == "the flow is over")
        meter.tick(final=True)


def tear_down_pool(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect hook (``on_failure``, ``on_crashed``, ``on_cancellation`` of the post-training flow): the run's
    workers leave (``pool/done.json``) and its SkyPilot jobs are cancelled. The flow's own ``worker_pool``
    does this when the flow body ends; the hook covers what it cannot: a flow process killed outright, whose
    crash the Prefect worker reports and runs this hook for."""
    params = flow_run.parameters
    config_path = Path(params.get("config_path") or "configs/tiny.yaml")
    if not config_path.is_absolute() and not config_path.exists():  # the hook may run outside the clone
        config_path = Path(__file__).resolve().parent.parent / config_path
    cfg = load_config(config_path, params.get("overrides"), params.get("run_url"))
    launcher = launcher_from_env()  # cancelled first: a worker told to leave first would exit 0 (SUCCEEDED)
    names = launcher.cancel_run(cfg.run_url) if isinstance(launcher, SkyLauncher) else []
    mark_pool_done(RunStore(cfg.run_url), f"the flow run ended {state.name}")
    log.warning("flow run %s ended %s: the workers of %s were told to leave; cancelled managed jobs %s",
                flow_run.name, state.name, cfg.run_url, names)


def _keep(pool: "LocalPool | SkyPool", meter: "ControllerMeter", stop: threading.Event) -> None:
    while not stop.wait(pool.poll_seconds):
        try:
            pool.keep()
            meter.tick()
        except Exception as e:  # noqa: BLE001 - a hiccup (store, SkyPilot API) is retried next round
            log.warning("worker pool check failed: %s", e)


class ControllerMeter:
    """The controller's ledger entries (stage ``controller``): the seconds since the previous one, at the
    price of the VM the flow runs on, with the S3 requests the flow's process sent meanwhile (and, apart,
    the time it spent waiting on stages and explorations with the requests of that waiting). Written
    every ``every_seconds`` and when the pool closes; the first covers the time since the process
    started (the controller is billed from its boot)."""

    def __init__(self, store: RunStore, instance: dict[str, Any], every_seconds: float = 60.0):
        self.every_seconds, self.last = every_seconds, process_start_time()
        self.waited = (WAITING.seconds, WAITING.requests)
        write_slot(store, CONTROLLER, {"kind": CONTROLLER, "seen_at": time.time(), "seen_by": socket.gethostname(),
                                       **instance})
        self.ledger = Ledger(store, CONTROLLER, CONTROLLER, 0.0, slot=CONTROLLER)

    def tick(self, final: bool = False) -> None:
        now = time.time()
        if final or now - self.last >= self.every_seconds:
            seconds, requests = WAITING.seconds, WAITING.requests
            self.ledger.waited(seconds - self.waited[0], requests - self.waited[1])
            self.ledger.record(CONTROLLER, None, now - self.last, Outcome.OK, 0.0)
            self.last, self.waited = now, (seconds, requests)


# -- local processes ------------------------------------------------------------------------------
def wait_until_ready(run_url: str, workers: dict[str, subprocess.Popen], timeout: float = 120.0) -> None:
    """Wait (bounded) until every local worker has opened the run, so the first stage finds them working
    instead of booting. A worker that dies or is late only costs speed: the pool starts it again."""
    store, deadline = RunStore(run_url), time.monotonic() + timeout
    for worker_id, proc in workers.items():
        key = ready_record_key(worker_id)
        while proc.poll() is None and time.monotonic() < deadline:
            if store.exists(key) and store.get_json(key)["pid"] == proc.pid:  # not a previous flow's record
                break
            time.sleep(0.05)
        else:
            warnings.warn(f"worker {worker_id} is not ready (exit code {proc.poll()}); going on without it")


class LocalPool:
    """``spotlight worker`` processes on this machine (an explorer with sequence parallelism: an SP group's
    launcher and its member processes), pinned to ``placement.<kind>.local_cpus``."""

    poll_seconds = 0.5

    def __init__(self, cfg: Config):
        self.cfg, self.store = cfg, RunStore(cfg.run_url)
        self.exe = str(Path(sys.executable).with_name("spotlight"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.kinds: dict[str, str] = {}
        self.failures: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()
        self.logs = Path(tempfile.mkdtemp(prefix="spotlight-workers-"))
        self._lock = threading.Lock()

    def controller_instance(self) -> dict[str, Any]:
        """The flow runs on this machine with its local workers: nothing is billed per hour here."""
        return {"instance": f"local {socket.gethostname()}", "price_per_hour": 0.0,
                "price_source": "this machine (local workers)"}

    def start(self) -> None:
        for kind, i in worker_slots(self.cfg):
            slot = f"local-{kind}-{i}"
            self.kinds[slot] = kind
            self._spawn(slot)
        wait_until_ready(self.cfg.run_url, dict(self.procs))

    def command(self, slot: str) -> list[str]:
        """A slot's process: ``spotlight worker``, or for an explorer with ``placement.sequence_parallel.degree``
        > 1 the launcher of its SP group (one member process per degree, the group named after the slot)."""
        kind, sp = self.kinds[slot], self.cfg.placement.sequence_parallel
        if kind == "explorer" and sp.degree > 1:
            return [sys.executable, "-m", "spotlight.sequence_parallel.launch", "--run", self.cfg.run_url,
                    "--group", slot, "--processes", str(sp.degree), "--device", self.cfg.run.device,
                    "--idle-exit", "86400"]
        return [self.exe, "worker", "--run", self.cfg.run_url, "--kind", kind, "--id", slot, "--idle-exit", "86400"]

    def _spawn(self, slot: str) -> None:
        kind, cmd = self.kinds[slot], self.command(slot)
        env = dict(os.environ, OMP_NUM_THREADS=str(self.cfg.run.threads), SPOTLIGHT_SLOT=slot)
        with open(self.logs / f"{slot}.log", "ab") as err:
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
                                    preexec_fn=term_with_parent)
        cpus = getattr(self.cfg.placement, kind).local_cpus
        if cpus:
            os.sched_setaffinity(proc.pid, set(cpus))
        self.procs[slot] = proc
        self.launches[slot] += 1

    def log_tail(self, slot: str, lines: int = 30) -> str:
        try:
            return "\n".join((self.logs / f"{slot}.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def keep(self) -> None:
        with self._lock:
            for slot, proc in list(self.procs.items()):
                code = proc.poll()
                if code is None or pool_done(self.store) or pool_broken(self.store):
                    continue
                if code not in NOT_A_FAILURE:
                    self.failures[slot] += 1
                if self.failures[slot] > self.cfg.placement.max_relaunches:
                    mark_pool_broken(self.store, slot, (
                        f"local worker {slot} ({self.kinds[slot]}) exited with code {code}, "
                        f"{self.failures[slot]} times (placement.max_relaunches is {self.cfg.placement.max_relaunches}); "
                        f"the end of its log:\n{self.log_tail(slot)}"))
                    continue
                log.warning("local worker %s exited (code %s); starting it again", slot, code)
                self._spawn(slot)

    def close(self, grace: bool = True) -> None:
        """SIGTERM every worker process (each records what it finished and releases its item), then wait.
        Their logs are removed after a flow that ended well (``grace``) with no worker failing, and kept,
        their folder named in the log, otherwise, unless they are all empty (nothing to read)."""
        with self._lock:
            procs = list(self.procs.values())
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            ended_well = grace and not self.failures and all(p.returncode in NOT_A_FAILURE for p in procs)
            if not ended_well and any(log_file.stat().st_size for log_file in self.logs.glob("*.log")):
                log.warning("the local workers' logs are kept in %s", self.logs)
            else:
                shutil.rmtree(self.logs, ignore_errors=True)


# -- SkyPilot managed jobs ------------------------------------------------------------------------
class SkyPool:
    """One SkyPilot managed job per worker, named ``spotlight-<run>-<hash>-<kind>-NNNN``."""

    def __init__(self, cfg: Config, launcher: SkyLauncher, close_grace_seconds: float = 60.0):
        self.cfg, self.launcher, self.store = cfg, launcher, RunStore(cfg.run_url)
        self.config = cfg.model_dump(mode="json")
        self.poll_seconds = launcher.poll_seconds
        self.close_grace_seconds = close_grace_seconds
        self.slots = {f"{run_prefix(cfg.run_url)}{kind}-{i:04d}": (kind, i) for kind, i in worker_slots(cfg)}
        self.failures: Counter[str] = Counter()
        self._seen: dict[str, Any] = {}

    def controller_instance(self) -> dict[str, Any]:
        return self.launcher.controller_instance()

    def start(self) -> None:
        for kind, i in self.slots.values():
            self.launcher.start(kind, i, self.config)

    def keep(self) -> None:
        """Each worker's newest job: running (record where, and how long it waited for a cluster), or ended
        while the run needs it (launch it again; a failure counts towards ``placement.max_relaunches``;
        SUCCEEDED, a worker that left on its own, does not)."""
        status = job_status()
        records = self.launcher.jobs.queue(run_prefix(self.cfg.run_url))
        for name, (kind, i) in self.slots.items():
            record = self.launcher.latest(name, records)
            if record is not None and not record["status"].is_terminal():
                self._record_instance(name, kind, record)
                continue
            if pool_done(self.store) or pool_broken(self.store):
                continue
            if record is not None and record["status"] != status.SUCCEEDED:
                self.failures[name] += 1
                if self.failures[name] > self.cfg.placement.max_relaunches:
                    mark_pool_broken(self.store, name, (
                        f"the {kind} {name} ended {self.failures[name]} times "
                        f"(placement.max_relaunches is {self.cfg.placement.max_relaunches}); the last time: "
                        f"{self.launcher.failure(name, record)}"))
                    continue
            log.warning("the %s %s is %s; launching it again", kind, name,
                        "gone" if record is None else f"{record['status'].value} (id {record['job_id']})")
            self.launcher.start(kind, i, self.config, relaunch=True)

    def _record_instance(self, name: str, kind: str, record: dict[str, Any]) -> None:
        """What the job runs on now, priced from the catalog (the worker's ledger entries read it), and,
        once it runs, the time SkyPilot spent provisioning it (a ledger entry of its own)."""
        resources = record.get("resources")
        if not resources:
            if record.get("resources_error"):
                log.warning("managed job %s: %s", name, record["resources_error"])
            return
        key = (record["job_id"], record.get("recovery_count"), repr(resources))
        if self._seen.get(name, (None,))[0] != key:
            try:
                priced = resources_price(resources)
            except PriceError as e:
                log.warning("managed job %s runs on %s, which the catalog cannot price (%s): its time is "
                            "recorded at $0", name, resources, e)
                priced = {"instance": f"{resources.get('cloud')}/{resources.get('region')} "
                                      f"{resources.get('instance_type')}",
                          "price_per_hour": 0.0, "price_source": f"unpriced: {e}"}
            write_slot(self.store, name, {
                "kind": kind, "job_id": record["job_id"], "recovery_count": record.get("recovery_count"),
                "resources": resources, "seen_at": time.time(), "seen_by": socket.gethostname(), **priced})
            self._seen[name] = (key, priced, False)
        key, priced, provisioned = self._seen[name]
        if not provisioned and record["status"] == job_status().RUNNING:
            if record_provisioning(self.store, name, kind, record, priced) is not None:
                self._seen[name] = (key, priced, True)

    def close(self, grace: bool = True) -> None:
        """The done marker is written: workers exit by themselves; cancel the ones still running after a grace
        (none when the flow stopped abnormally: a cancelled worker still records what it finished)."""
        deadline = time.monotonic() + (self.close_grace_seconds if grace else 0.0)
        while time.monotonic() < deadline:
            records = self.launcher.jobs.queue(run_prefix(self.cfg.run_url))
            active = [n for n in self.slots if (r := self.launcher.latest(n, records)) is not None
                      and not r["status"].is_terminal()]
            if not active:
                return
            time.sleep(min(self.poll_seconds, 1.0))
        for name in self.slots:
            record = self.launcher.latest(name)
            if record is not None and not record["status"].is_terminal():
                self.launcher.jobs.cancel(name)
