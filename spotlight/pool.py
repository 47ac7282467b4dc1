"""The worker pool's records in the run store: what the flow, the pool and the workers tell each other.

A leaf (it needs only the store): the stage queue, the cost ledger, the workers and the pool
(``tasks/workers.py``) all read these, and none of them needs the others to do so.

Layout, under the run store::

    pool/done.json           the flow is over: workers exit
    pool/broken.json         a worker could not be kept alive: waiting stages fail with it
    pool/slots/{slot}.json   a worker slot's instance and price (written by the pool, read by the ledger)
    workers/{worker}.json    a worker is ready: imports done, run opened (host, pid, time)
"""

from __future__ import annotations

import os
import time
from typing import Any

from spotlight.store import RunStore, StoreError

POOL_DONE, POOL_BROKEN, POOL_SLOTS = "pool/done.json", "pool/broken.json", "pool/slots"


def default_poll_seconds(store: RunStore) -> float:
    """How often to look at the queue: a local disk is cheap to poll, S3 requests cost ~20 ms and money.
    ``SPOTLIGHT_POLL_SECONDS`` overrides it (e.g. an S3-compatible server on the same machine)."""
    if os.environ.get("SPOTLIGHT_POLL_SECONDS"):
        return float(os.environ["SPOTLIGHT_POLL_SECONDS"])
    return 0.02 if store.is_local else 0.5


def pool_done(store: RunStore) -> bool:
    return store.exists(POOL_DONE)


def mark_pool_done(store: RunStore, reason: str) -> None:
    store.put_json(POOL_DONE, {"reason": reason, "at": time.time()})


def reset_pool(store: RunStore) -> None:
    """A flow starting (or resuming) the run: workers are wanted again."""
    store.delete(POOL_DONE)
    store.delete(POOL_BROKEN)


def mark_pool_broken(store: RunStore, slot: str, reason: str) -> None:
    store.put_json(POOL_BROKEN, {"slot": slot, "reason": reason, "at": time.time()})


def pool_broken(store: RunStore) -> dict[str, Any] | None:
    try:
        return store.get_json(POOL_BROKEN)
    except StoreError:
        return None


def write_slot(store: RunStore, slot: str, record: dict[str, Any]) -> None:
    """What the pool knows of a worker slot's current instance (kind, instance, price, where from)."""
    store.put_json(f"{POOL_SLOTS}/{slot}.json", record)


def read_slot(store: RunStore, slot: str) -> dict[str, Any] | None:
    try:
        return store.get_json(f"{POOL_SLOTS}/{slot}.json")
    except StoreError:
        return None


def ready_record_key(worker_id: str) -> str:
    """Where a worker records that it is ready (imports done, run opened): host, pid, time."""
    return f"workers/{worker_id}.json"
