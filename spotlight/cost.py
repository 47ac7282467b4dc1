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
from spotlight.store import AlreadyExistsError, RunStore, json_bytes

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
           where: str, **extra: Any) -> dict[str, Any]:
    """Write one ledger entry (never overwritten) and return it. ``iteration`` None: work of no iteration
    (a worker's boot or its idle tail). ``extra``: worker, kind, instance, outcome, idle_seconds, ..."""
    idle = float(extra.pop("idle_seconds", 0.0))
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
        "where": where,
        "recorded_at": time.time(),
        **extra,
    }
    head = "none" if iteration is None else f"{iteration:04d}"
    while True:  # a unique name per attempt; the loop only turns on a same-nanosecond collision
        key = f"{PREFIX}/{head}-{stage}-{time.time_ns()}-{os.getpid()}.json"
        try:
            store.create_bytes(key, json_bytes(entry))
            return entry
        except AlreadyExistsError:
            continue


class Ledger:
    """One worker's writer of ledger entries: each attempt with the idle time (held, waiting) since the
    worker's previous entry (or since it was made: the boot). Priced where the worker runs now
    (:func:`worker_instance`: the pool's slot record, else ``local_price``). A failed write is logged,
    never raised: a ledger write must not turn into a lost stage."""

    def __init__(self, store: RunStore, worker: str, kind: str, local_price: float, slot: str | None = None):
        self.store, self.worker, self.kind, self.local_price, self.slot = store, worker, kind, local_price, slot
        self.idle_from = time.time()  # the end of the previous entry: idle time starts here

    def idle(self) -> float:
        """Seconds held and idle since the previous entry."""
        return max(0.0, time.time() - self.idle_from)

    def record(self, stage: str, iteration: int | None, seconds: float, outcome: Outcome, idle_seconds: float,
               **extra: Any) -> None:
        """Write the attempt's entry (``extra``: attempt, units, degree, ...); idle time restarts now."""
        try:
            where = worker_instance(self.store, self.kind, self.local_price, self.slot)
            record(self.store, stage, iteration, max(seconds, 0.0), where["price_per_hour"],
                   f"{self.worker} on {where['instance']}", worker=self.worker, kind=self.kind,
                   instance=where["instance"], price_source=where["price_source"], outcome=outcome,
                   idle_seconds=idle_seconds, **extra)
        except Exception as e:  # noqa: BLE001 - a ledger write must never turn into a lost stage
            log.warning("cost entry for %s %s not written: %s", stage, iteration, e)
        self.idle_from = time.time()


def ledger(store: RunStore) -> list[dict[str, Any]]:
    """All entries of the run, ordered by iteration (none first), stage and time."""
    entries = [store.get_json(f"{PREFIX}/{name}") for name in store.list(PREFIX) if name.endswith(".json")]
    return sorted(entries, key=lambda e: (-1 if e["iteration"] is None else e["iteration"], e["stage"],
                                          e["recorded_at"]))


def entry_cost(e: dict[str, Any]) -> float:
    """What an entry paid for: the attempt and the idle time before it."""
    return e["cost_usd"] + e.get("idle_cost_usd", 0.0)


def total(store: RunStore) -> float:
    """What the run has cost so far, in US dollars (attempts and workers' idle time)."""
    return sum(entry_cost(e) for e in ledger(store))


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
    """Per stage: attempts, failed/preempted attempts, seconds and dollars (idle time is its own row)."""
    out: dict[str, dict[str, float]] = {}
    for e in entries:
        row = out.setdefault(e["stage"], {"attempts": 0, "not_ok": 0, "seconds": 0.0, "cost_usd": 0.0})
        row["attempts"] += 1
        row["not_ok"] += e.get("outcome") in NOT_OK
        row["seconds"] += e["seconds"]
        row["cost_usd"] += e["cost_usd"]
        if e.get("idle_seconds"):
            idle = out.setdefault("idle", {"attempts": 0, "not_ok": 0, "seconds": 0.0, "cost_usd": 0.0})
            idle["seconds"] += e["idle_seconds"]
            idle["cost_usd"] += e.get("idle_cost_usd", 0.0)
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
    """The instance and $/h of a SkyPilot job record's resources (cloud, region, zone, instance_type,
    accelerators, use_spot), from the catalog: the instance type's row, else the accelerator's."""
    cloud, region, zone = resources["cloud"], resources["region"], resources.get("zone")
    use_spot = bool(resources.get("use_spot"))
    if resources.get("instance_type"):
        price = instance_price(cloud, resources["instance_type"], region, zone, use_spot, catalog_dir)
        instance = resources["instance_type"]
    else:
        (name, count), = dict(resources["accelerators"]).items()
        instance, price = accelerator_price(f"{name}:{count}", cloud, region, use_spot, catalog_dir)
    where = "/".join(x for x in (cloud, region, zone) if x)
    return {"instance": f"{where} {instance}{' [spot]' if use_spot else ''}", "price_per_hour": price,
            "use_spot": use_spot, "cloud": cloud, "region": region, "zone": zone, "instance_type": instance,
            "price_source": f"catalog {catalog_dir.name} ({'zone spot row' if use_spot and zone else 'row'})"}


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
