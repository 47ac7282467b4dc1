"""The cost ledger of a run: one immutable entry per stage attempt, in the run store.

Why a ledger rather than a counter: a preempted stage that is retried costs twice, and both
attempts must be paid for; append-only entries (create-only writes, unique names) survive any
number of concurrent writers and restarts, and ``spotlight plan --run`` reads real stage durations
from them. The embedded default records price 0.0 with ``where="local"``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from spotlight.store import AlreadyExistsError, RunStore, json_bytes

PREFIX = "cost"


def record(store: RunStore, stage: str, iteration: int, seconds: float, price_per_hour: float,
           where: str) -> dict[str, Any]:
    """Write one ledger entry (never overwritten) and return it."""
    if seconds < 0 or price_per_hour < 0:
        raise ValueError(f"cost entry for {stage} iteration {iteration}: seconds ({seconds}) and "
                         f"price_per_hour ({price_per_hour}) must be >= 0")
    entry = {
        "stage": stage,
        "iteration": int(iteration),
        "seconds": float(seconds),
        "price_per_hour": float(price_per_hour),
        "cost_usd": float(seconds) / 3600.0 * float(price_per_hour),
        "where": where,
        "recorded_at": time.time(),
    }
    while True:  # a unique name per attempt; the loop only turns on a same-nanosecond collision
        key = f"{PREFIX}/{iteration:04d}-{stage}-{time.time_ns()}-{os.getpid()}.json"
        try:
            store.create_bytes(key, json_bytes(entry))
            return entry
        except AlreadyExistsError:
            continue


def ledger(store: RunStore) -> list[dict[str, Any]]:
    """All entries of the run, ordered by iteration, stage and time."""
    entries = [store.get_json(f"{PREFIX}/{name}") for name in store.list(PREFIX) if name.endswith(".json")]
    return sorted(entries, key=lambda e: (e["iteration"], e["stage"], e["recorded_at"]))


def total(store: RunStore) -> float:
    """What the run has cost so far, in US dollars."""
    return sum(e["cost_usd"] for e in ledger(store))


def stage_hours_per_iteration(entries: list[dict[str, Any]]) -> dict[str, float]:
    """Mean hours per iteration of each stage (all attempts of an iteration added up)."""
    per: dict[str, dict[int, float]] = {}
    for e in entries:
        per.setdefault(e["stage"], {}).setdefault(e["iteration"], 0.0)
        per[e["stage"]][e["iteration"]] += e["seconds"] / 3600.0
    return {stage: sum(its.values()) / len(its) for stage, its in per.items()}
