"""A pull-based, preemption-aware work queue that lives in the run store (``file://`` or ``s3://``).

Why pull-based: spot workers come and go; each worker claims the next free item when it is ready, so
fast workers take more items and a preempted one costs only the item it held.

Everything is an immutable, create-only object (no read-modify-write, no locks, no overwrites), so the
same code is correct on a local disk (``os.link``, like ``O_EXCL``) and on S3 (``If-None-Match: *``):

    {prefix}/items/COMMIT.json, items.json      the published items (one commit: all or nothing)
    {prefix}/leases/{item}/{epoch}-{renewal}    a lease epoch (renewal 000000 = the claim) and its renewals
    {prefix}/leases/{item}/{epoch}-released     the holder handed the item back (SIGTERM path)
    {prefix}/units/{item}/{unit}                one finished unit's result; the first write wins
    {prefix}/done/{item}                        the completion marker; exactly one worker creates it
    {prefix}/progress.json, freed.json          signals: rewritten on every change / when an item is handed back

A claim creates the next epoch's ``-000000`` object, so two workers can never hold the same epoch; a
holder that finds a newer epoch has lost its lease (it was presumed dead) and stops. Expiry compares
the holder's ``expires`` with the claimant's clock, so worker clocks must agree to well within a lease
(NTP does). Units are recorded create-only and results are deterministic per unit, so a unit computed
twice (by a zombie holder and its successor) is harmless: the first result is kept.

Waiting is cheap (O(1) requests a look, whatever the queue's size): a worker's ``claim`` on a queue whose
items are all held costs one HEAD of ``freed.json`` until an item is handed back or a lease it saw could
have expired (then one LIST of all leases, however many items); a ``look`` (``drained``, ``changed``) is
one GET of ``progress.json``, whose body names the change and the done items its writer saw. Every change
writes its state first and the signal after, with a body of its own, so a reader that sees a signal's new
version and then reads finds the change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from spotlight.fencing import FencingToken
from spotlight.store import AlreadyExistsError, RunStore, StoreError, json_bytes

NAME = re.compile(r"[A-Za-z0-9_=+-]{1,200}")  # no dots: temp files of in-flight local writes contain one
LEASE = re.compile(r"(\d{6})-(\d{6}|released)")
PROGRESS, FREED = "progress.json", "freed.json"  # signals: any change; an item handed back (or published)
#: what a change's signal may name; a body naming none of these (or none at all) makes its reader list
EVENTS = frozenset({"published", "claimed", "units", "released", "done", "failed"})
FULL_LOOK_EVERY = 30.0  # seconds: a waiter lists the done markers at least this often while undrained
log = logging.getLogger(__name__)


class QueueError(StoreError):
    """A queue used wrongly (bad names, a conflicting publish, completing unfinished work)."""


class LeaseLostError(QueueError):
    """The claim's lease was taken over (it expired) or released: stop working on the item."""


@dataclass
class Claim:
    """A held lease epoch of one item."""

    item: dict[str, Any]
    worker: str
    epoch: int
    expires: float
    renewals: int = 0
    recorded: dict[str, Any] = field(default_factory=dict, repr=False)  # units this claim recorded first

    @property
    def item_id(self) -> str:
        return self.item["id"]


@dataclass
class _LeaseState:
    epoch: int | None  # latest epoch, None if never claimed
    expires: float
    released: bool

    def free(self, now: float) -> bool:
        return self.epoch is None or self.released or now >= self.expires


@dataclass
class WorkQueue:
    """The queue under ``prefix`` in ``store``; many WorkQueue objects (processes, machines) may share it."""

    store: RunStore
    prefix: str
    lease_seconds: float = 60.0
    clock: Callable[[], float] = time.time
    _items: list[dict[str, Any]] | None = field(default=None, repr=False)
    _unit_cache: dict[str, Any] = field(default_factory=dict, repr=False)
    _markers: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)  # done markers read (immutable)
    _idle_look: tuple[str | None, float] = field(default=(None, 0.0), repr=False)  # freed.json, until when
    _seen: bytes | None = field(default=None, repr=False)  # progress.json's body at the last look
    _looked_at: float | None = field(default=None, repr=False)  # monotonic, the last look (None: never)
    _listed_at: float = field(default=-math.inf, repr=False)  # monotonic, the last listing of the done markers
    _done_known: set[str] = field(default_factory=set, repr=False)  # done items (markers are never removed)
    last_event: str | None = field(default=None, repr=False)  # what the last change seen was (``look``)
    just_published: bool = field(default=False, repr=False)  # this object published the items, not looked since

    def __post_init__(self) -> None:
        self.prefix = self.prefix.strip("/")
        if self.lease_seconds <= 0:
            raise QueueError(f"lease_seconds must be > 0, got {self.lease_seconds}")

    # -- publishing --------------------------------------------------------------------------
    def publish(self, items: list[dict[str, Any]]) -> None:
        """Publish the items as one commit. Idempotent; publishing different items here is an error."""
        _validate(items)
        key = f"{self.prefix}/items"
        if not self.store.is_committed(key):
            self.store.commit(key, {"items.json": json_bytes(items)}, {"items": len(items)})
            # nothing is done yet: this object's first look needs no listing, and its waiter may sleep first
            self._seen = self._signal(PROGRESS, FREED, event="published")
            self._looked_at = self._listed_at = time.monotonic()
            self.just_published = True
        published = self.store.load(key).json("items.json")
        if published != json.loads(json_bytes(items)):
            raise QueueError(f"{self.store.url}/{self.prefix} already holds {len(published)} other items; "
                             "a queue's items are immutable, publish under another prefix")
        self._items = published

    def published(self) -> bool:
        return bool(self.items())

    def items(self) -> list[dict[str, Any]]:
        """The published items (empty before publish); cached, since a published queue is immutable."""
        if self._items is None:
            if not self.store.is_committed(f"{self.prefix}/items"):
                return []
            self._items = self.store.load(f"{self.prefix}/items").json("items.json")
        return self._items

    def item(self, item_id: str) -> dict[str, Any]:
        for item in self.items():
            if item["id"] == item_id:
                return item
        raise QueueError(f"{self.store.url}/{self.prefix} has no item {item_id!r}")

    # -- leases ------------------------------------------------------------------------------
    def claim(self, worker: str) -> Claim | None:
        """Claim an unfinished item whose lease is free (never claimed, released or expired), or None.

        When the last look found nothing free, the next costs one HEAD (``freed.json``) until an item is
        handed back or a lease seen then may have expired; a full look is one LIST of the done markers and
        one of all leases, then the exact check (the holder's own ``expires``) of the items that look free."""
        _check_name(worker, "worker")
        items = self.items()
        if not items:
            return None
        freed = self.store.version(self._signal_key(FREED))
        seen, until = self._idle_look
        if freed is not None and freed == seen and self.clock() < until:
            return None
        done = self._done()
        # the store's write times are wall-clock: with an injected clock (tests), every item is checked exactly
        leases = self._all_leases() if self.clock is time.time else {}
        # Each worker scans from its own offset, so workers starting together rarely collide.
        start = int(hashlib.sha256(worker.encode()).hexdigest(), 16) % max(len(items), 1)
        held_until = math.inf
        for item in items[start:] + items[:start]:
            if item["id"] in done:
                continue
            seen_until = leases.get(item["id"])
            if seen_until is not None and self.clock() < seen_until:
                held_until = min(held_until, seen_until)
                continue
            state = self._lease_state(item["id"])
            if not state.free(self.clock()):
                held_until = min(held_until, state.expires)
                continue
            epoch = 0 if state.epoch is None else state.epoch + 1
            expires = self.clock() + self.lease_seconds
            try:
                self.store.create_bytes(self._lease_key(item["id"], epoch, 0),
                                        json_bytes({"worker": worker, "epoch": epoch, "renewal": 0, "expires": expires}))
            except AlreadyExistsError:
                continue  # another worker claimed this epoch first
            self._idle_look = (None, 0.0)
            self._signal(PROGRESS, event="claimed", done=done)
            return Claim(item, worker, epoch, expires)
        self._idle_look = (freed, held_until)
        return None

    def held_until(self) -> float:
        """After a claim that found nothing to take: when a lease it saw may expire (wall clock; inf when
        no lease can: every item is done). Before then only a hand-back (``freed.json``) frees an item."""
        return self._idle_look[1]

    def _all_leases(self) -> dict[str, float]:
        """Per item with a live-looking lease, when it looks free (one LIST of every lease object): the newest
        epoch's last write plus a lease, or nothing if that epoch was released."""
        newest: dict[str, tuple[int, bool, float]] = {}
        for key, written in self.store.list_tree(f"{self.prefix}/leases").items():
            item, _, name = key.rpartition("/")
            m = LEASE.fullmatch(name)
            if not m:
                continue
            epoch, released = int(m.group(1)), m.group(2) == "released"
            old = newest.get(item)
            if old is None or epoch > old[0]:
                newest[item] = (epoch, released, written)
            elif epoch == old[0]:
                newest[item] = (epoch, old[1] or released, max(old[2], written))
        return {item: written + self.lease_seconds for item, (_, released, written) in newest.items() if not released}

    def look(self) -> tuple[bool, bool]:
        """(changed since the previous look, drained): one GET of ``progress.json``, whatever happened.

        A change is a claim, a hand-back, recorded units, a completion or a failure (``mark_changed``);
        the body names it (``last_event``) and, for a claim or a completion, the done items its writer saw
        (a completion lists the done markers after creating its own). The done markers are listed only at
        the first look (unless nothing happened since the publish), after a change the body cannot account
        for, and every ``FULL_LOOK_EVERY`` seconds while the queue is not drained (a completion whose
        signal a later change overwrote before anyone read it). The first look says changed."""
        items = self.items()
        raw = self._signal_body(PROGRESS)
        now = time.monotonic()
        changed = self._looked_at is None or raw != self._seen
        body = _signal_fields(raw) if changed else {}
        if changed:
            self._seen, self.last_event = raw, body.get("event")
            self._done_known.update(body.get("done", ()))
            if body.get("event") == "done" and isinstance(body.get("marker"), dict):
                self._markers.setdefault(body["item"], body["marker"])  # markers are create-only: final
        drained = bool(items) and self._done_known >= {it["id"] for it in items}
        first = self._looked_at is None
        if first and body.get("event") == "published":  # nothing has happened since the publish
            first, self._listed_at = False, now
        if first or (changed and body.get("event") not in EVENTS) or (
                not drained and now - self._listed_at >= FULL_LOOK_EVERY):
            self._done_known.update(self._done())
            self._listed_at = now
            drained = bool(items) and self._done_known >= {it["id"] for it in items}
        self._looked_at, self.just_published = now, False
        return changed, drained

    def mark_changed(self, event: str = "failed") -> None:
        """Tell the queue's watchers something changed (a stage attempt recorded its failure)."""
        self._signal(PROGRESS, event=event)

    def _signal_key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def _signal_body(self, name: str) -> bytes | None:
        try:
            return self.store.read_bytes(self._signal_key(name), small=True)
        except StoreError:
            return None

    def _signal(self, *names: str, event: str, done: set[str] | None = None,
                marker: tuple[str, dict[str, Any]] | None = None) -> bytes:
        """Rewrite signal objects after a change (each body unique, so each write is a new version), naming
        the change, the done items the writer knows and, for a completion, its done marker (so that a waiter
        on a one-item queue, a stage, reads no marker). A hint: a failed write only delays a reader until
        it looks in full (``FULL_LOOK_EVERY``, a lease's expiry), and is logged."""
        body = json_bytes({"at": self.clock(), "nonce": secrets.token_hex(8), "event": event,
                           **({} if done is None else {"done": sorted(done)}),
                           **({} if marker is None else {"item": marker[0], "marker": marker[1]})})
        for name in names:
            try:
                self.store.write_bytes(self._signal_key(name), body)
            except (StoreError, OSError) as e:
                log.warning("%s/%s not written: %s", self.prefix, name, e)
        return body

    def renew(self, claim: Claim) -> None:
        """Extend the lease by lease_seconds (heartbeat); raises LeaseLostError if it was taken over."""
        self.check_held(claim)
        renewal, expires = claim.renewals + 1, self.clock() + self.lease_seconds
        self.store.create_bytes(self._lease_key(claim.item_id, claim.epoch, renewal),
                                json_bytes({"worker": claim.worker, "epoch": claim.epoch, "renewal": renewal,
                                            "expires": expires}))
        claim.renewals, claim.expires = renewal, expires

    def release(self, claim: Claim) -> None:
        """Hand the item back now, so another worker can claim it without waiting for expiry."""
        try:
            self.store.create_bytes(f"{self.prefix}/leases/{claim.item_id}/{claim.epoch:06d}-released",
                                    json_bytes({"worker": claim.worker, "epoch": claim.epoch, "at": self.clock()}))
        except AlreadyExistsError:
            return
        self._signal(PROGRESS, FREED, event="released")

    def release_stale(self, worker: str) -> list[str]:
        """Release the items whose newest lease ``worker`` holds: called by a worker as it starts, so the
        leases of its previous life (the same name across a SkyPilot recovery, or a relaunched local
        process) free their items at once instead of after the lease expires. If that previous life is
        somehow still running, its next renewal finds the release and it stops (LeaseLostError)."""
        released = []
        done = self._done()
        for item in self.items():
            if item["id"] in done:
                continue
            names = self._lease_names(item["id"])
            if not names:
                continue
            epoch = max(e for e, _ in names)
            if (epoch, "released") in names:
                continue
            holder = self.store.get_json(self._lease_key(item["id"], epoch, 0))["worker"]
            if holder == worker:
                self.release(Claim(item, worker, epoch, 0.0))
                released.append(item["id"])
        return released

    def check_held(self, claim: Claim) -> None:
        """Raise LeaseLostError if the claim's lease was taken over (a newer epoch) or released: one LIST.

        Expiry alone does not lose a lease: an expired lease nobody claimed again is still this holder's."""
        names = self._lease_names(claim.item_id)
        newer = [e for e, _ in names if e > claim.epoch]
        if newer or (claim.epoch, "released") in names:
            raise LeaseLostError(f"{claim.worker} lost its lease on {self.prefix}/{claim.item_id} (epoch {claim.epoch}): "
                                 + (f"epoch {max(newer)} took over" if newer else "it was released"))

    def fence(self, claim: Claim) -> FencingToken:
        """The claim's fencing token: ``RunStore.commit(..., fence=token)`` (or a ``store.fenced(token)``
        view) refuses to commit once ``check_held`` fails, so a worker that lost its lease commits nothing."""
        return FencingToken(claim.worker, f"{self.store.url}/{self.prefix}/{claim.item_id}", claim.epoch,
                            lambda: self.check_held(claim))

    def _lease_key(self, item_id: str, epoch: int, renewal: int) -> str:
        return f"{self.prefix}/leases/{item_id}/{epoch:06d}-{renewal:06d}"

    def _lease_names(self, item_id: str) -> list[tuple[int, str]]:
        out = []
        for name in self.store.list(f"{self.prefix}/leases/{item_id}"):
            m = LEASE.fullmatch(name)
            if m:
                out.append((int(m.group(1)), m.group(2)))
        return out

    def _lease_state(self, item_id: str) -> _LeaseState:
        names = self._lease_names(item_id)
        if not names:
            return _LeaseState(None, 0.0, False)
        epoch = max(e for e, _ in names)
        if (epoch, "released") in names:
            return _LeaseState(epoch, 0.0, True)
        renewal = max(int(r) for e, r in names if e == epoch and r != "released")
        return _LeaseState(epoch, self.store.get_json(self._lease_key(item_id, epoch, renewal))["expires"], False)

    # -- results -----------------------------------------------------------------------------
    def record(self, claim: Claim, results: dict[str, Any]) -> int:
        """Commit finished units now (create-only per unit: a unit recorded twice keeps its first result).

        Returns how many units this call recorded first."""
        units = set(claim.item["units"])
        unknown = sorted(set(results) - units)
        if unknown:
            raise QueueError(f"item {claim.item_id!r} has no units {unknown[:5]}")
        new = 0
        for unit, result in results.items():
            data = json_bytes({"result": result, "worker": claim.worker, "epoch": claim.epoch})
            try:
                self.store.create_bytes(f"{self.prefix}/units/{claim.item_id}/{unit}", data)
            except AlreadyExistsError:
                continue
            claim.recorded[unit] = json.loads(data)["result"]  # as a reader will see it
            new += 1
        if new:
            self._signal(PROGRESS, event="units")
        return new

    def complete(self, claim: Claim) -> bool:
        """Create the item's done marker; True for exactly one worker, False if another completed it.

        The marker also holds the item's results (as first recorded), so a reader of a finished queue
        makes one GET per item instead of one per unit (hundreds of round trips on S3)."""
        pending = self.pending_units(claim.item_id)
        if pending:
            raise QueueError(f"cannot complete {self.prefix}/{claim.item_id}: {len(pending)} units not recorded "
                             f"(e.g. {pending[:3]})")
        results = {u: claim.recorded[u] if u in claim.recorded else self._unit(claim.item_id, u)
                   for u in claim.item["units"]}
        data = json_bytes({"worker": claim.worker, "epoch": claim.epoch, "at": self.clock(), "results": results})
        try:
            self.store.create_bytes(f"{self.prefix}/done/{claim.item_id}", data)
        except AlreadyExistsError:
            return False
        # this worker's LIST and marker: its waiters need neither
        self._signal(PROGRESS, event="done", done=self._done(), marker=(claim.item_id, json.loads(data)))
        return True

    def done_marker(self, item_id: str) -> dict[str, Any] | None:
        """The item's done marker (worker, epoch, results): from a completion signal a look read, else one
        GET; None if not done."""
        if item_id not in self._markers:
            try:
                self._markers[item_id] = self.store.get_json(f"{self.prefix}/done/{item_id}")
            except StoreError:
                return None
        return self._markers[item_id]

    def done_by(self, item_id: str) -> str | None:
        """The worker whose complete() won for the item, or None if not done."""
        marker = self.done_marker(item_id)
        return None if marker is None else marker["worker"]

    def pending_units(self, item_id: str) -> list[str]:
        """The item's units nobody has recorded yet, in item order."""
        recorded = self._recorded(item_id)
        return [u for u in self.item(item_id)["units"] if u not in recorded]

    def results(self) -> dict[str, Any]:
        """All recorded units of all items: {unit: result} (done items from their marker, one read each)."""
        out: dict[str, Any] = {}
        done = self._done()
        for item in self.items():
            if item["id"] in done:
                out.update(self.done_marker(item["id"])["results"])  # type: ignore[index]
            else:
                out.update({u: self._unit(item["id"], u) for u in self._recorded(item["id"])})
        return out

    def _unit(self, item_id: str, unit: str) -> Any:
        if unit not in self._unit_cache:
            self._unit_cache[unit] = self.store.get_json(f"{self.prefix}/units/{item_id}/{unit}")["result"]
        return self._unit_cache[unit]

    def status(self) -> dict[str, int]:
        items, done, now = self.items(), self._done(), self.clock()
        leased = sum(1 for it in items if it["id"] not in done and not self._lease_state(it["id"]).free(now))
        return {"items": len(items), "done": len(done), "leased": leased, "free": len(items) - len(done) - leased,
                "units_done": sum(len(self._recorded(it["id"])) for it in items),
                "units_total": sum(len(it["units"]) for it in items)}

    def drained(self) -> bool:
        """All items done (False before publish: there is work to wait for): :meth:`look`'s answer."""
        return self.look()[1]

    def _done(self) -> set[str]:
        return {n for n in self.store.list(f"{self.prefix}/done") if NAME.fullmatch(n)}

    def _recorded(self, item_id: str) -> set[str]:
        units = set(self.item(item_id)["units"])
        return {n for n in self.store.list(f"{self.prefix}/units/{item_id}") if n in units}


def _signal_fields(raw: bytes | None) -> dict[str, Any]:
    """A signal's body, or {} when it is missing or unreadable (its reader then lists)."""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise QueueError(f"bad {what} name {name!r}: use 1-200 of A-Z a-z 0-9 _ = + - (it becomes a store key)")


def _validate(items: list[dict[str, Any]]) -> None:
    ids: set[str] = set()
    units: set[str] = set()
    for item in items:
        if not isinstance(item, dict) or "id" not in item or not isinstance(item.get("units"), list):
            raise QueueError(f"a queue item is a dict with 'id' and a list 'units', got {item!r:.200}")
        _check_name(item["id"], "item")
        if item["id"] in ids:
            raise QueueError(f"duplicate item id {item['id']!r}")
        ids.add(item["id"])
        for unit in item["units"]:
            _check_name(unit, "unit")
            if unit in units:
                raise QueueError(f"unit {unit!r} appears twice (units are unique across a queue's items)")
            units.add(unit)
