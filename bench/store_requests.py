"""S3 requests per run-store operation, as a moto S3 server received them, this checkout beside a baseline.

    OMP_NUM_THREADS=1 .venv/bin/python bench/store_requests.py [--baseline /path/to/another/checkout]

Each side runs in its own process (``PYTHONPATH`` set to the checkout) against its own moto server
(``ThreadedMotoServer`` on 127.0.0.1) and counts the HTTP requests the server logged (werkzeug's
access log), by AWS billing class: PUT/COPY/POST/LIST, GET/HEAD/other, DELETE (free). Where the
checkout has ``spotlight.store.request_counts`` (the store's own counter), its counts are printed too
and must agree. Prices: S3 Standard, us-east-1 ($0.005 and $0.0004 per 1,000).

The waiting rows are one look of a process that waits while every item of a 28-item queue is held:
the controller waiting on the exploration (the baseline's loop: ``drained()`` and ``status()``; now
``look()``) and an idle worker looking for an item (``claim()``, after a first look). The rates printed
below the table put a look at the loop's cadence: the baseline's 0.5 s, now the longest pause (4 s).

What it does not show: latency (moto on localhost), LIST pages beyond the first 1,000 keys, or the
short-wait cadence (a tenth of the time waited, from 0.5 s: a busy run's waits look more often).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRICE = {"put": 0.005 / 1000, "get": 0.0004 / 1000}
ITEMS = 28  # the example: a 28-item exploration queue
WAITING = ("a waiting controller's look", "an idle worker's look")
PACE = {"this checkout": 4.0, "baseline": 0.5}  # seconds between two looks of a long wait


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ServerLog(logging.Handler):
    LINE = re.compile(r'"(GET|PUT|HEAD|DELETE|POST) (\S+) HTTP/')
    COLOUR = re.compile(r"\x1b\[[0-9;]*m")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.counts = {"put": 0, "get": 0, "free": 0}

    def emit(self, record: logging.LogRecord) -> None:
        m = self.LINE.search(self.COLOUR.sub("", record.getMessage()))
        if m:
            method, path = m.groups()
            kind = "free" if method == "DELETE" else \
                "put" if method in ("PUT", "POST") or "list-type=" in path else "get"
            self.counts[kind] += 1


def measure() -> dict[str, dict[str, int]]:
    """One side: the requests of each operation (run in the checkout under test)."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    os.environ.update(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="AKIABENCH",
                      AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    log = _ServerLog()
    werkzeug = logging.getLogger("werkzeug")
    werkzeug.setLevel(logging.INFO)
    werkzeug.addHandler(log)
    werkzeug.propagate = False
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")

    from spotlight import checkpoints, store as store_module
    from spotlight.config import CheckpointSection
    from spotlight.store import RunStore
    from spotlight.work_queue import WorkQueue

    counter = getattr(store_module, "request_counts", None)
    store = RunStore("s3://bench/run")

    def key(stage: str, t: int) -> str:
        return f"iterations/{t:04d}/{stage}"

    objects = {"policy.safetensors": b"p" * 4096, "optimizer.safetensors": b"o" * 8192,
               "rewards.safetensors": b"r" * 512, "metrics.json": b"{}"}
    queue = WorkQueue(store, "queues/explore-0001", lease_seconds=3600)
    queue.publish([{"id": f"item-{i:02d}", "units": [f"u{i:02d}-{j}" for j in range(4)]} for i in range(ITEMS)])
    while queue.claim("explorer-0") is not None:  # every item leased
        pass
    out: dict[str, dict[str, int]] = {}

    def op(name: str, fn) -> None:
        before, ours = dict(log.counts), counter() if counter else None
        fn()
        out[name] = {k: log.counts[k] - before[k] for k in log.counts}
        if counter:
            delta = counter() - ours
            out[name]["counted"] = {"put": delta.put, "get": delta.get, "free": delta.free}

    for t in range(3):
        op(f"commit update({t}) (4 objects)", lambda t=t: store.commit(key("update", t), objects, {"iteration": t}))
    op("commit again (already committed)", lambda: store.commit(key("update", 2), objects))
    op("load + read 4 objects", lambda: [c.read(o) for c in [store.load(key("update", 2))] for o in objects])
    op("is_committed, not yet (a wait poll)", lambda: store.is_committed(key("update", 9)))
    op(f"queue.status(), {ITEMS} items leased (a wait poll)", queue.status)
    op(f"queue.claim(), {ITEMS} items leased (a scan)", lambda: queue.claim("explorer-1"))
    waiter, idle = (WorkQueue(store, "queues/explore-0001", lease_seconds=3600) for _ in range(2))
    look = getattr(waiter, "look", None) or (lambda: (waiter.drained(), waiter.status()))
    look()
    op(f"{WAITING[0]}, {ITEMS} items leased", look)
    idle.claim("explorer-2")
    op(f"{WAITING[1]}, {ITEMS} items leased", lambda: idle.claim("explorer-2"))
    op("checkpoints.prune(keep_last=2) after update(2)",
       lambda: checkpoints.prune(store, CheckpointSection(keep_last=2), 2, key))
    server.stop()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, help="another checkout (e.g. a main worktree) to measure beside this one")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return
    sides = {"this checkout": REPO, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    results = {}
    for side, root in sides.items():
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True,
                              cwd=root, check=True)
        results[side] = json.loads(proc.stdout.strip().splitlines()[-1])

    from rich.console import Console
    from rich.table import Table

    table = Table(title="S3 requests per operation, as moto's server received them (PUT-class / GET-class / DELETE)")
    table.add_column("operation")
    for side in results:
        table.add_column(side, justify="right")
        table.add_column(f"$ per 1M ({side})", justify="right")
    if len(results) == 2:
        table.add_column("$ ratio (this / baseline)", justify="right")
    for name in results["this checkout"]:
        row, dollars = [name], []
        for side in results:
            c = results[side].get(name)
            if c is None:
                row += ["-", "-"]
                continue
            usd = (c["put"] * PRICE["put"] + c["get"] * PRICE["get"]) * 1e6
            dollars.append(usd)
            agree = "" if "counted" not in c else (" =" if c["counted"] == {k: c[k] for k in ("put", "get", "free")}
                                                    else f" (counted {c['counted']})")
            row += [f"{c['put']} / {c['get']} / {c['free']}{agree}", f"{usd:.2f}"]
        if len(results) == 2:
            row.append(f"{dollars[0] / dollars[1]:.2f}" if len(dollars) == 2 and dollars[1] else "-")
        table.add_row(*row)
    console = Console(width=200)
    console.print(table)
    console.print("'=' : the store's own counter (spotlight.store.request_counts) counted the same. A wait poll at "
                  "2 per second costs $ per 1M x 0.0072 per hour.", soft_wrap=True)
    for what in WAITING:
        for side, counts in results.items():
            c = next(v for k, v in counts.items() if k.startswith(what))
            n, usd = c["put"] + c["get"], c["put"] * PRICE["put"] + c["get"] * PRICE["get"]
            console.print(f"{what} ({side}): {n} requests a look, a look every {PACE[side]:g} s: "
                          f"{n / PACE[side]:.2f} requests/s, ${usd / PACE[side] * 3600:.4f} per hour", soft_wrap=True)


if __name__ == "__main__":
    main()
