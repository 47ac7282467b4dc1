"""The cost ledger of a run: one immutable entry per stage attempt, in the run store.

Why a ledger rather than a counter: a preempted stage that is retried costs twice, and both
attempts must be paid for; append-only entries (create-only writes, unique names) survive any
number of concurrent writers and restarts, and ``spotlight plan --run`` reads real stage durations
from them.

Who writes: the worker that ran the attempt, in a ``finally``, so a failed or preempted (SIGTERM)
attempt is recorded with the seconds it took (only a kill -9 leaves no entry: nothing runs). An entry
carries the instance and its price per hour:

* a cloud worker: the instance SkyPilot's record of its managed job names (the pool writes it to
  ``pool/slots/<slot>.json``: cloud, region, zone, instance type, spot or not), priced from the catalog
  row of that instance type (``sky/catalog/v8``); if the record is stale (the worker was recovered
  elsewhere and the pool has not seen it yet), the catalog price of the accelerator it got, in the
  region it runs in (``SKYPILOT_CLUSTER_INFO``);
* a local worker: ``placement.<kind>.price_per_hour`` (0 by default).

Beside the attempt's own ``seconds`` an entry has ``idle_seconds``: how long the worker was held but
idle (booting, waiting for work) since its previous entry, which a long-lived worker pays for too.
A worker writes through its :class:`Ledger`, which carries that idle time; how the attempt ended is
an :class:`Outcome`.

What else is paid for, each its own entry (or field) so a forecast can read it:

* ``requests`` / ``idle_requests``: the S3 requests the process sent during the attempt and during the
  idle time before it, by billing class (``store.request_counts``), priced per 1,000
  (``store.S3_PRICE_PER_1000``) into ``s3_cost_usd``;
* stage ``provision``: the time SkyPilot spent getting a worker a cluster (the first launch and every
  recovery), from its managed-job record, at the price of what it got (written by the pool,
  :func:`record_provisioning`); the setup (``pip install``) before the worker's process starts is in
  its ``boot`` entry (``setup_seconds``);
* stage ``controller``: the VM the flow runs on (SkyPilot's record of its cluster, priced from the
  catalog), with the S3 requests of the flow's process, written by the pool every few minutes.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from spotlight.catalog import CATALOG_DIR, PriceError, accelerator_price, instance_price
from spotlight.pool import read_slot
from spotlight.store import (S3_PRICE_PER_1000, AlreadyExistsError, RequestCounts, RunStore, StoreError, json_bytes,
                             request_counts)

PREFIX = "cost"
log = logging.getLogger(__name__)


class Outcome(StrEnum):
    """How the attempt of a ledger entry ended (its ``outcome``; an entry read back holds the plain string)."""

    OK = "ok"                  # the work is done: a stage committed, an item completed, a worker booted
    FAILED = "failed"          # the stage or handler raised (a stage's failed.json has the error)
    PREEMPTED = "preempted"    # SIGTERM: the stage was abandoned, or the item released with its finished units
    LEASE_LOST = "lease-lost"  # the lease expired and another worker took the item over: it finishes it
    REGROUP = "regroup"        # an SP explorer group released its item to change its membership
    EXIT = "exit"              # a worker's idle tail as it leaves (stage ``idle``)


#: attempt outcomes that did not finish their work
NOT_OK = frozenset({Outcome.FAILED, Outcome.PREEMPTED, Outcome.LEASE_LOST, Outcome.REGROUP})


def record(store: RunStore, stage: str, iteration: int | None, seconds: float, price_per_hour: float,
           where: str, key: str | None = None, **extra: Any) -> dict[str, Any]:
    """Write one ledger entry (never overwritten) and return it. ``iteration`` None: work of no iteration
    (a worker's boot or its idle tail). ``key``: the entry's name, for an entry that must be written once
    however often it is recorded (the one already there is returned). ``extra``: worker, kind, instance,
    outcome, idle_seconds, requests and idle_requests (``RequestCounts``), ..."""
    idle = float(extra.pop("idle_seconds", 0.0))
    requests = [extra.pop(k, None) or RequestCounts() for k in ("requests", "idle_requests")]
    if seconds < 0 or price_per_hour < 0 or idle < 0:
        raise ValueError(f"cost entry for {stage} iteration {iteration}: seconds ({seconds}), idle seconds ({idle}) "
                         f"and price_per_hour ({price_per_hour}) must be >= 0")
    entry = {
        "stage": stage,
        "iteration": None if iteration is None else int(iteration),
        "seconds": float(seconds),
        "price_per_hour": float(price_per_hour),
        "cost_usd": float(seconds) / 3600.0 * float(price_per_hour),
        "idle_seconds": idle,
        "idle_cost_usd": idle / 3600.0 * float(price_per_hour),
        "requests": requests[0].as_dict(),
        "idle_requests": requests[1].as_dict(),
        "s3_cost_usd": sum(r.cost_usd() for r in requests),
        "where": where,
        "recorded_at": time.time(),
        **extra,
    }
    head = "none" if iteration is None else f"{iteration:04d}"
    if key is not None:
        name = f"{PREFIX}/{head}-{stage}-{key}.json"
        try:
            store.create_bytes(name, json_bytes(entry))
            return entry
        except AlreadyExistsError:
            return store.get_json(name)
    while True:  # a unique name per attempt; the loop only turns on a same-nanosecond collision
        name = f"{PREFIX}/{head}-{stage}-{time.time_ns()}-{os.getpid()}.json"
        try:
            store.create_bytes(name, json_bytes(entry))
            return entry
        except AlreadyExistsError:
            continue


class Ledger:
    """One worker's writer of ledger entries: each attempt with the idle time (held, waiting) since the
    worker's previous entry (or since it was made: the boot), and the S3 requests of both. Priced where
    the worker runs now (:func:`worker_instance`: the pool's slot record, else ``local_price``). A failed
    write is logged, never raised: a ledger write must not turn into a lost stage."""

    def __init__(self, store: RunStore, worker: str, kind: str, local_price: float, slot: str | None = None):
        self.store, self.worker, self.kind, self.local_price, self.slot = store, worker, kind, local_price, slot
        self.idle_from = time.time()  # the end of the previous entry: idle time starts here
        self.requests_from = self.attempt_requests_from = request_counts()
        self.waiting_seconds, self.waiting_requests = 0.0, RequestCounts()

    def waited(self, seconds: float, requests: RequestCounts) -> None:
        """A round that looked for work and found none: its seconds and requests go into the next entry
        as ``waiting_seconds`` / ``waiting_requests`` (already billed with the idle time; kept apart so
        that what waiting costs is seen without the claims and reads around the work)."""
        self.waiting_seconds += seconds
        self.waiting_requests = self.waiting_requests + requests

    def idle(self) -> float:
        """Seconds held and idle since the previous entry. Call it as an attempt starts: the S3 requests
        sent from now on are the attempt's, those before it the idle time's."""
        self.attempt_requests_from = request_counts()
        return max(0.0, time.time() - self.idle_from)

    def record(self, stage: str, iteration: int | None, seconds: float, outcome: Outcome, idle_seconds: float,
               **extra: Any) -> None:
        """Write the attempt's entry (``extra``: attempt, units, degree, ...); idle time restarts now."""
        now = request_counts()
        idle_requests = self.attempt_requests_from - self.requests_from if idle_seconds else RequestCounts()
        requests = now - (self.attempt_requests_from if idle_seconds else self.requests_from)
        try:
            where = worker_instance(self.store, self.kind, self.local_price, self.slot)
            record(self.store, stage, iteration, max(seconds, 0.0), where["price_per_hour"],
                   f"{self.worker} on {where['instance']}", worker=self.worker, kind=self.kind,
                   instance=where["instance"], price_source=where["price_source"], outcome=outcome,
                   idle_seconds=idle_seconds, requests=requests, idle_requests=idle_requests,
                   waiting_seconds=self.waiting_seconds, waiting_requests=self.waiting_requests.as_dict(), **extra)
        except Exception as e:  # noqa: BLE001 - a ledger write must never turn into a lost stage
            log.warning("cost entry for %s %s not written: %s", stage, iteration, e)
        self.idle_from = time.time()
        self.requests_from = self.attempt_requests_from = request_counts()
        self.waiting_seconds, self.waiting_requests = 0.0, RequestCounts()


def process_start_time() -> float:
    """When this process started (Linux: /proc), so what it did before its first entry is paid for too (a
    worker's imports, the controller's boot). Counted back from now through ``/proc/uptime`` (10 ms
    steps), not from ``/proc/stat``'s ``btime``, which is truncated to the second and could put the start
    up to a second early."""
    try:
        ticks = int(open("/proc/self/stat").read().rsplit(")", 1)[1].split()[19])
        uptime = float(open("/proc/uptime").read().split()[0])
        return time.time() - max(0.0, uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def ledger(store: RunStore) -> list[dict[str, Any]]:
    """All entries of the run, ordered by iteration (none first), stage and time."""
    entries = [store.get_json(f"{PREFIX}/{name}") for name in store.list(PREFIX) if name.endswith(".json")]
    return sorted(entries, key=lambda e: (-1 if e["iteration"] is None else e["iteration"], e["stage"],
                                          e["recorded_at"]))


def entry_cost(e: dict[str, Any]) -> float:
    """What an entry paid for: the attempt, the idle time before it, and the S3 requests of both."""
    return e["cost_usd"] + e.get("idle_cost_usd", 0.0) + e.get("s3_cost_usd", 0.0)


def total(store: RunStore) -> float:
    """What the run has cost so far, in US dollars (attempts, workers' idle time, provisioning, the
    controller, S3 requests)."""
    return sum(entry_cost(e) for e in ledger(store))


def requests_per_second_waiting(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Per process, the S3 requests it sent per second while it waited: a worker's rounds that looked for
    work and found none, the controller's waits on stages and explorations."""
    sent: dict[str, float] = {}
    seconds: dict[str, float] = {}
    for e in entries:
        who = e.get("worker") or e["stage"]
        n, t = sum(e.get("waiting_requests", {}).get(k, 0) for k in S3_PRICE_PER_1000), e.get("waiting_seconds", 0.0)
        sent[who] = sent.get(who, 0.0) + n
        seconds[who] = seconds.get(who, 0.0) + t
    return {who: sent[who] / seconds[who] for who in sent if seconds[who] > 0}


KIND_OF_STAGE = {"pretrain": "trainer", "update": "trainer", "evaluate": "trainer", "ranking": "trainer",
                 "explore": "explorer"}


def kind_hours_per_iteration(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Mean busy hours per iteration of each worker kind (all attempts of an iteration added up; an
    exploration counts under the kind that ran it). Entries of no iteration are left out."""
    per: dict[str, dict[int, float]] = {}
    for e in entries:
        kind = e.get("kind") or KIND_OF_STAGE.get(e["stage"])
        if kind is None or e["iteration"] is None:
            continue
        per.setdefault(kind, {}).setdefault(e["iteration"], 0.0)
        per[kind][e["iteration"]] += e["seconds"] / 3600.0
    return {kind: sum(its.values()) / len(its) for kind, its in per.items()}


def stage_hours_per_iteration(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Mean hours per iteration of each stage (all attempts of an iteration added up)."""
    per: dict[str, dict[int, float]] = {}
    for e in entries:
        if e["iteration"] is None:
            continue
        per.setdefault(e["stage"], {}).setdefault(e["iteration"], 0.0)
        per[e["stage"]][e["iteration"]] += e["seconds"] / 3600.0
    return {stage: sum(its.values()) / len(its) for stage, its in per.items()}


# -- summaries for the report ------------------------------------------------------------------------
def by_stage(entries: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per stage: attempts, failed/preempted attempts, seconds and dollars (idle time and S3 requests
    are rows of their own: ``idle``, ``s3-requests``, whose ``attempts`` counts requests)."""
    out: dict[str, dict[str, float]] = {}

    def row(name: str) -> dict[str, float]:
        return out.setdefault(name, {"attempts": 0, "not_ok": 0, "seconds": 0.0, "cost_usd": 0.0})

    for e in entries:
        stage = row(e["stage"])
        stage["attempts"] += 1
        stage["not_ok"] += e.get("outcome") in NOT_OK
        stage["seconds"] += e["seconds"]
        stage["cost_usd"] += e["cost_usd"]
        if e.get("idle_seconds"):
            row("idle")["seconds"] += e["idle_seconds"]
            row("idle")["cost_usd"] += e.get("idle_cost_usd", 0.0)
        if e.get("s3_cost_usd"):
            row("s3-requests")["attempts"] += sum(e.get(k, {}).get(c, 0) for k in ("requests", "idle_requests")
                                                  for c in S3_PRICE_PER_1000)
            row("s3-requests")["cost_usd"] += e["s3_cost_usd"]
    return out


def by_iteration(entries: list[dict[str, Any]]) -> dict[int | None, float]:
    """Dollars per iteration (attempts and the idle time that preceded them); None: no iteration."""
    out: dict[int | None, float] = {}
    for e in entries:
        out[e["iteration"]] = out.get(e["iteration"], 0.0) + entry_cost(e)
    return out


def cost_until(entries: list[dict[str, Any]], when: float) -> float:
    """Dollars recorded up to a moment (entries recorded at or before ``when``): what the run had paid by then."""
    return sum(entry_cost(e) for e in entries if e["recorded_at"] <= when)


# -- what an instance costs -------------------------------------------------------------------------
def resources_price(resources: dict[str, Any], catalog_dir: Path = CATALOG_DIR) -> dict[str, Any]:
    """The instance and $/h of a SkyPilot record's resources (cloud, region, zone, instance_type,
    accelerators, use_spot, nodes: ``tasks.launcher.parse_resources``), from the catalog: the instance
    type's row (spot: its zone's row, else the region's median), else the accelerator's; times the nodes."""
    cloud, region, zone = resources["cloud"], resources["region"], resources.get("zone")
    use_spot, nodes = bool(resources.get("use_spot")), int(resources.get("nodes") or 1)
    if resources.get("instance_type"):
        price = instance_price(cloud, resources["instance_type"], region, zone, use_spot, catalog_dir)
        instance = resources["instance_type"]
    else:
        (name, count), = dict(resources["accelerators"]).items()
        instance, price = accelerator_price(f"{name}:{count:g}", cloud, region, use_spot, catalog_dir)
    where = "/".join(x for x in (cloud, region, zone) if x)
    return {"instance": f"{where} {f'{nodes}x ' if nodes > 1 else ''}{instance}{' [spot]' if use_spot else ''}",
            "price_per_hour": price * nodes, "use_spot": use_spot, "nodes": nodes, "cloud": cloud, "region": region,
            "zone": zone, "instance_type": instance,
            "price_source": f"catalog {catalog_dir.name} ({'spot' if use_spot else 'on-demand'} row"
                            f"{' x ' + str(nodes) + ' nodes' if nodes > 1 else ''})"}


def worker_instance(store: RunStore, kind: str, local_price: float, slot: str | None = None,
                    environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The instance this worker runs on and its price, for its ledger entries.

    SkyPilot worker (``SPOTLIGHT_SLOT`` set by the launcher): the pool's record of its job's resources,
    if it matches where this process runs (``SKYPILOT_CLUSTER_INFO``); else the catalog price of the
    record's accelerator in the region this process runs in. Local worker: the configured price."""
    env = os.environ if environ is None else environ
    slot = slot or env.get("SPOTLIGHT_SLOT")
    record = read_slot(store, slot) if slot else None
    cluster = json.loads(env["SKYPILOT_CLUSTER_INFO"]) if env.get("SKYPILOT_CLUSTER_INFO") else None
    if record is not None:
        res = record.get("resources")
        moved = res and cluster and (str(res.get("cloud")).lower(), res.get("region")) != \
            (str(cluster.get("cloud")).lower(), cluster.get("region"))
        if not moved:
            return {"instance": record.get("instance", "unknown"), "price_per_hour": float(record.get("price_per_hour", 0.0)),
                    "price_source": record.get("price_source", "pool"), "slot": slot}
        # recovered elsewhere and the pool has not seen it yet: the catalog price of the accelerator it
        # got, in the region it runs in now
        res = {**res, "cloud": cluster["cloud"], "region": cluster["region"], "zone": cluster.get("zone"),
               "instance_type": None}
        try:
            return {**resources_price(res), "slot": slot}
        except PriceError as e:
            return {"instance": f"{res['cloud']}/{res['region']} (unpriced)", "price_per_hour": 0.0,
                    "price_source": f"unpriced: {e}", "slot": slot}
    return {"instance": f"local {socket.gethostname()}", "price_per_hour": float(local_price),
            "price_source": f"placement.{kind}.price_per_hour", "slot": slot}


def unrecorded_cost(entries: list[dict[str, Any]], since: float, now: float) -> float:
    """Dollars the workers still held have cost since their last entry: a worker records its idle time only
    with its next entry, so the ledger alone lags what is being paid. A worker counts if its last entry is
    from ``since`` on (it belongs to the current flow run) and is not its exit."""
    last: dict[str, dict[str, Any]] = {}
    for e in entries:
        worker = e.get("worker")
        if worker and (worker not in last or e["recorded_at"] > last[worker]["recorded_at"]):
            last[worker] = e
    return sum(max(0.0, now - e["recorded_at"]) / 3600.0 * e["price_per_hour"] for e in last.values()
               if e["recorded_at"] >= since and e.get("outcome") != Outcome.EXIT)


def record_provisioning(store: RunStore, slot: str, kind: str, job: dict[str, Any],
                        priced: dict[str, Any]) -> dict[str, Any] | None:
    """The pool's ledger entry for the time SkyPilot spent getting a running job its cluster, from the
    job's own record: while it runs, ``last_recovered_at - submitted_at - job_duration`` is all the time
    it was not running (``job_duration`` is what it ran before its last recovery, setup included: SkyPilot's
    ``sky/jobs/state.py``), so each recovery adds one stretch. One entry per (job, recovery count),
    written once however often the pool looks (or restarts), holding the stretch since the previous
    one. An upper bound of what is billed: the cloud bills from the instance's start, within the stretch.
    None when the record has no finished stretch (not running, no timestamps)."""
    submitted, recovered = job.get("submitted_at"), job.get("last_recovered_at")
    if not submitted or recovered is None or recovered < 0:
        return None
    waited = max(0.0, float(recovered) - float(submitted) - float(job.get("job_duration") or 0.0))
    job_id, count = int(job["job_id"]), int(job.get("recovery_count") or 0)

    def key(n: int) -> str:
        return f"{slot}-j{job_id:06d}-r{n:04d}"

    before = 0.0
    for n in range(count - 1, -1, -1):  # the latest stretch already written for this job
        try:
            before = float(store.get_json(f"{PREFIX}/none-provision-{key(n)}.json")["waited_seconds"])
            break
        except StoreError:  # not written (the pool missed that stretch): look further back
            continue
    return record(store, "provision", None, max(0.0, waited - before), priced["price_per_hour"],
                  f"{slot} on {priced['instance']}", key=key(count), worker=slot, kind=kind,
                  instance=priced["instance"], price_source=priced["price_source"], outcome=Outcome.OK,
                  job_id=job_id, recovery_count=count, waited_seconds=waited)
