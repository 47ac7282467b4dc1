"""Who is in the group: the generations of an elastic sequence-parallel group, agreed in the run store.

The members of a group are independent processes (one per GPU; on spot, possibly one per VM), so they
meet through the one thing they all reach and that outlives any of them: the run store (``file://``
here, ``s3://`` in the cloud). Everything is create-only except a member's own record:

    {prefix}/members/{member}          the member's record, rewritten every heartbeat: host, pid,
                                       has_weights, beat (wall clock; clocks agree via NTP, as the
                                       work queue's leases already assume)
    {prefix}/left/{member}             create-only: the member left for good (SIGTERM); never included again
    {prefix}/ready/{g:06d}/{member}    create-only: the member is out of generation g-1 (or new) and asks into g
    {prefix}/generations/{g:06d}       create-only: generation g: members in rank order, spares, the
                                       members that receive weights, and the address of its TCPStore
    {prefix}/working/{g:06d}           generation g's first seed started (written by its leader)
    {prefix}/stats/{member}            what the member did (written when it exits)

A **generation** is one process group: fixed members, fixed degree. It ends when a member fails (a
collective raises: a dead peer's sockets reset at once; a hung one times out after
``collective_timeout_seconds``), when a member leaves (SIGTERM: the group stops after the seed in hand),
or at a unit boundary when waiting processes would allow a larger degree. Then every survivor tears
its process group down and asks into g+1.

Who decides g+1: one proposer, the *first* live asker in a fixed order -- weight holders first, then
the members of g by rank, then the others by name -- if it holds weights (a new process without
weights never leads). It proposes once every live member of g has asked (a clean regroup), or
``regroup_grace_seconds`` after it asked itself (a failure: the dead never ask; a survivor slower
than that waits as a spare and joins at the next unit boundary), or, for the first generation, once
``degree`` processes asked (or after ``join_timeout_seconds``). g+1 is only proposed once g is over
(one of its members asks, or all of them are gone), so a waiting spare never breaks a working group.
The proposer takes the largest valid degree k of the askers in that order: the first k are members
(it is rank 0: it hosts the generation's TCPStore and sends weights to those without), the rest are
spares. It writes ``generations/{g+1}`` create-only; if another proposal won the race, it follows that one.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch.distributed as dist

from spotlight.config import SequenceParallelSection
from spotlight.store import AlreadyExistsError, RunStore, StoreError, json_bytes
from spotlight.work_queue import NAME

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Generation:
    """One process group of the elastic group."""

    number: int
    members: tuple[str, ...]  # rank order; members[0] leads, hosts the store and sends weights
    spares: tuple[str, ...]   # alive and asking, left out because the degree would not be valid
    receivers: tuple[str, ...]  # members that hold no weights yet: they get them from members[0]
    host: str
    port: int
    proposed_at: float

    @property
    def degree(self) -> int:
        return len(self.members)

    def rank(self, member: str) -> int:
        return self.members.index(member)

    @staticmethod
    def from_json(data: dict[str, Any]) -> "Generation":
        return Generation(data["number"], tuple(data["members"]), tuple(data["spares"]), tuple(data["receivers"]),
                          data["host"], data["port"], data["proposed_at"])


class Rendezvous:
    """One member's view of its group's generations, under ``prefix`` of the run store."""

    def __init__(self, store: RunStore, prefix: str, member: str, sp: SequenceParallelSection,
                 degree_ok: Callable[[int], bool], host: str | None = None) -> None:
        if not NAME.fullmatch(member):
            raise ValueError(f"bad member name {member!r}: use 1-200 of A-Z a-z 0-9 _ = + -")
        self.store = store
        self.prefix = prefix.strip("/")
        self.member = member
        self.sp = sp
        self.degree_ok = degree_ok
        self.host = host or socket.gethostbyname(socket.gethostname())
        self.has_weights = False
        self._beat_stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._hosted: dict[int, dist.TCPStore] = {}  # stores this member serves, by generation

    # -- the member's record -----------------------------------------------------------------
    def announce(self, has_weights: bool) -> None:
        """Write this member's record now (and from then on every heartbeat)."""
        self.has_weights = has_weights
        self.store.put_json(f"{self.prefix}/members/{self.member}", {
            "member": self.member, "host": socket.gethostname(), "pid": os.getpid(),
            "has_weights": self.has_weights, "beat": time.time()})

    def start_heartbeat(self) -> None:
        def beat() -> None:
            while not self._beat_stop.wait(self.sp.heartbeat_seconds):
                try:
                    self.announce(self.has_weights)
                except (StoreError, OSError) as e:  # one missed beat is within dead_after_seconds
                    log.warning("heartbeat of %s failed: %s", self.member, e)

        self._beat = threading.Thread(target=beat, daemon=True, name=f"sp-heartbeat-{self.member}")
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._beat_stop.set()
        if self._beat is not None:
            self._beat.join()

    def leave(self) -> None:
        """Never include this member again (it got SIGTERM: its machine is going away)."""
        try:
            self.store.create_bytes(f"{self.prefix}/left/{self.member}", json_bytes({"at": time.time()}))
        except AlreadyExistsError:
            pass

    # -- reading the group ---------------------------------------------------------------------
    def _names(self, sub: str) -> list[str]:
        return [n for n in self.store.list(f"{self.prefix}/{sub}") if NAME.fullmatch(n)]

    def live(self) -> dict[str, dict[str, Any]]:
        """Records of the members whose heartbeat is fresh and who have not left."""
        left = set(self._names("left"))
        now, out = time.time(), {}
        for name in self._names("members"):
            if name in left:
                continue
            try:
                record = self.store.get_json(f"{self.prefix}/members/{name}")
            except StoreError:
                continue
            if now - record["beat"] < self.sp.dead_after_seconds:
                out[name] = record
        return out

    def latest(self) -> Generation | None:
        numbers = self._names("generations")
        if not numbers:
            return None
        return Generation.from_json(self.store.get_json(f"{self.prefix}/generations/{max(numbers)}"))

    def generations(self) -> list[Generation]:
        return [Generation.from_json(self.store.get_json(f"{self.prefix}/generations/{n}"))
                for n in self._names("generations")]

    def asking(self, number: int) -> list[str]:
        return self._names(f"ready/{number:06d}")

    def waiting(self, gen: Generation) -> list[str]:
        """Live processes outside ``gen`` that ask into the next generation (spares, replacements)."""
        live = self.live()
        return [m for m in self.asking(gen.number + 1) if m in live and m not in gen.members]

    # -- joining -------------------------------------------------------------------------------
    def _ask(self, number: int) -> None:
        try:
            self.store.create_bytes(f"{self.prefix}/ready/{number:06d}/{self.member}",
                                    json_bytes({"at": time.time()}))
        except AlreadyExistsError:
            pass

    def join(self, give_up: Callable[[], bool]) -> Generation | None:
        """Block until a generation that includes this member exists; None if ``give_up()`` first."""
        latest = self.latest()
        target = latest.number + 1 if latest else 0
        self._ask(target)
        asked = time.monotonic()
        next_check = asked
        while True:
            latest = self.latest()
            if latest is not None and latest.number >= target:
                if self.member in latest.members:
                    self._drop_hosted(keep=latest.number)
                    return latest
                target = latest.number + 1  # formed without this member: ask into the next one
                self._ask(target)
                asked = time.monotonic()
                continue
            now = time.monotonic()
            if now >= next_check:  # give_up may read the store: not on every poll
                if give_up():
                    self._drop_hosted(keep=None)
                    return None
                next_check = now + self.sp.heartbeat_seconds
            self._maybe_propose(target, latest, asked)
            time.sleep(0.01 if now - asked < 2.0 else 0.1)

    def _maybe_propose(self, target: int, previous: Generation | None, asked: float) -> None:
        if not self.has_weights:
            return
        live = self.live()
        asking = [m for m in self.asking(target) if m in live]
        before = previous.members if previous else ()
        if previous is not None and not set(before) & set(asking) and any(m in live for m in before):
            return  # generation `previous` is still working
        order = sorted(asking, key=lambda m: (not live[m]["has_weights"],
                                              before.index(m) if m in before else len(before), m))
        if not order or order[0] != self.member:
            return
        waited = time.monotonic() - asked
        if previous is None:
            ready = len(order) >= self.sp.degree or waited >= self.sp.join_timeout_seconds
        else:
            expected = {m for m in before if m in live}
            ready = expected <= set(asking) or waited >= self.sp.regroup_grace_seconds
        if not ready:
            return
        k = max(d for d in range(1, min(len(order), self.sp.degree) + 1) if self.degree_ok(d))
        server = dist.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=self.sp.join_timeout_seconds))
        gen = Generation(target, tuple(order[:k]), tuple(order[k:]),
                         tuple(m for m in order[:k] if not live[m]["has_weights"]), self.host, server.port,
                         time.time())
        try:
            self.store.create_bytes(f"{self.prefix}/generations/{target:06d}", json_bytes(asdict(gen)))
        except AlreadyExistsError:
            return  # another proposal won; the server is dropped with this frame
        self._hosted[target] = server

    def _drop_hosted(self, keep: int | None) -> None:
        """Stop serving the stores of older generations (their groups are torn down)."""
        for number in [n for n in self._hosted if n != keep]:
            del self._hosted[number]

    def connect(self, gen: Generation) -> dist.Store:
        """The generation's store: this member's own server if it leads, else a client of the leader's."""
        if gen.number in self._hosted:
            return self._hosted[gen.number]
        return dist.TCPStore(gen.host, gen.port, is_master=False,
                             timeout=datetime.timedelta(seconds=self.sp.join_timeout_seconds))
