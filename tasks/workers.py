"""Exploration workers for a run: ``spotlight worker`` processes beside the flow (embedded default),
or SkyPilot spot jobs running the same command (sky/explore_worker.yaml) when SPOTLIGHT_LAUNCHER=sky.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from spotlight.config import Config
from tasks.launcher import SkyLauncher, launcher_from_env

PR_SET_PDEATHSIG = 1


@contextmanager
def exploration_workers(cfg: Config) -> Iterator[None]:
    """The run's exploration workers for the duration of the flow; none in mode ``none``."""
    launcher = launcher_from_env()
    n = cfg.exploration.workers if cfg.exploration.mode != "none" else 0
    if not isinstance(launcher, SkyLauncher):
        with local_workers(cfg):
            yield
        return
    config = cfg.model_dump(mode="json")
    names = [launcher.start("explore", i, config)[0] for i in range(n)]
    try:
        yield
    finally:
        for name in names:  # workers exit by themselves when idle; cancel the ones still waiting
            launcher.jobs.cancel(name)


def _term_with_parent() -> None:
    """Linux: SIGTERM the worker when the flow's process dies (even by kill -9), so none is orphaned;
    on SIGTERM a worker records what it finished and releases its item."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_until_ready(run_url: str, workers: dict[str, subprocess.Popen], timeout: float = 120.0) -> None:
    """Wait (bounded) until every local worker has opened the run, so the first exploration finds
    them working instead of booting. A worker that dies or is late only costs speed: the trainer
    explores too while it waits, and a stalled queue is explored in-process."""
    from spotlight.store import RunStore
    from spotlight.worker import ready_record_key

    store, deadline = RunStore(run_url), time.monotonic() + timeout
    for worker_id, proc in workers.items():
        key = ready_record_key(worker_id)
        while proc.poll() is None and time.monotonic() < deadline:
            if store.exists(key) and store.get_json(key)["pid"] == proc.pid:  # not a previous flow's record
                break
            time.sleep(0.05)
        else:
            warnings.warn(f"exploration worker {worker_id} is not ready (exit code {proc.poll()}); going on without it")


@contextmanager
def local_workers(cfg: Config) -> Iterator[list[subprocess.Popen]]:
    """Start ``exploration.workers`` worker processes for the run; SIGTERM them (they commit and release) on exit."""
    exe = str(Path(sys.executable).with_name("spotlight"))
    workers: dict[str, subprocess.Popen] = {}
    for i in range(cfg.exploration.workers if cfg.exploration.mode != "none" else 0):
        worker_id = f"local-{i}"
        cmd = [exe, "worker", "--run", cfg.run_url, "--id", worker_id, "--idle-exit", "86400", "--poll-seconds", "0.05",
               "--lease-seconds", str(cfg.exploration.lease_seconds)]
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.run.threads))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_term_with_parent)
        if cfg.exploration.worker_cpus:
            os.sched_setaffinity(proc.pid, set(cfg.exploration.worker_cpus))
        workers[worker_id] = proc
    procs = list(workers.values())
    try:
        wait_until_ready(cfg.run_url, workers)
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
