"""A deterministic work-queue handler for tests, and the entry point that runs it as a worker process.

Each unit's result is the sha256 of its name, computed after sleeping ``item["sleep"]`` seconds, so a
signal sent while a worker is busy lands mid-item and every run (faulty or not) must give one table.

    python tests/queue_handler.py URL PREFIX WORKER [--lease S] [--batch N] [--poll S] [--idle-exit S]
prints a "ready" JSON line once SIGTERM is handled, then its stats as one JSON line, and exits 0
(also after SIGTERM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
import time
from typing import Any, Iterator

from spotlight.store import RunStore
from spotlight.work_queue import WorkQueue
from spotlight.queue_worker import install_sigterm_handler, run_worker


def unit_result(unit: str) -> str:
    return hashlib.sha256(unit.encode()).hexdigest()


def handler(item: dict[str, Any], units: list[str]) -> Iterator[tuple[str, str]]:
    for unit in units:
        time.sleep(item.get("sleep", 0.0))
        yield unit, unit_result(unit)


def make_items(n_items: int, n_units: int, sleep: float, tag: str = "i") -> list[dict[str, Any]]:
    return [{"id": f"{tag}{i:03d}", "units": [f"{tag}{i:03d}-u{j:02d}" for j in range(n_units)], "sleep": sleep}
            for i in range(n_items)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("prefix")
    p.add_argument("worker")
    p.add_argument("--lease", type=float, default=60.0)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--poll", type=float, default=0.1)
    p.add_argument("--idle-exit", type=float, default=None)
    a = p.parse_args()
    stop = threading.Event()
    install_sigterm_handler(stop)
    print(json.dumps({"ready": a.worker}), flush=True)  # the test signals only workers that can take it
    queue = WorkQueue(RunStore(a.url), a.prefix, lease_seconds=a.lease)
    stats = run_worker(queue, handler, worker_id=a.worker, batch_units=a.batch, stop=stop,
                       poll_seconds=a.poll, idle_exit_seconds=a.idle_exit)
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
