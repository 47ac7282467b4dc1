"""Local exploration workers for the embedded default: ``spotlight worker`` processes beside the flow.

In the cloud each worker is a SkyPilot spot job running the same command (sky/explore_worker.yaml).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from spotlight.config import Config


@contextmanager
def local_workers(cfg: Config) -> Iterator[list[subprocess.Popen]]:
    """Start ``exploration.workers`` worker processes for the run; SIGTERM them (they commit and release) on exit."""
    exe = str(Path(sys.executable).with_name("spotlight"))
    procs = []
    for i in range(cfg.exploration.workers if cfg.exploration.mode != "none" else 0):
        cmd = [exe, "worker", "--run", cfg.run_url, "--id", f"local-{i}", "--idle-exit", "86400", "--poll-seconds", "0.05",
               "--lease-seconds", str(cfg.exploration.lease_seconds)]
        env = dict(os.environ, OMP_NUM_THREADS=str(cfg.run.threads))
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, start_new_session=True)
        if cfg.exploration.worker_cpus:
            os.sched_setaffinity(proc.pid, set(cfg.exploration.worker_cpus))
        procs.append(proc)
    try:
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
