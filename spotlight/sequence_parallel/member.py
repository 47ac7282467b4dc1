"""A member of an elastic sequence-parallel group: one persistent process per GPU, holding the policy.

A group is one explorer of the run (``placement.sequence_parallel.degree`` > 1). It pulls the run's
exploration queues, the items and units plain explorers pull (:mod:`spotlight.exploration`: an item
per prompt, a unit per fixed batch of seeds), and rolls out each seed of a unit together: every member
runs the same SDE sampler (:func:`spotlight.exploration.exploration_rollout`, noise drawn from the
seed's CPU generator, so the same numbers on every member) and the transformer's forward is sharded
along the sequence by diffusers' context parallelism, its output all-gathered.

Rank 0 leads. It holds the work-queue lease (in the group's name, ``sp-{group}``), picks the next seed
and commits each finished seed at once: its final latent (content-addressed), then a seed record under
the queue (``{queue}/seeds/{unit}/{k}``, create-only). When a unit's seeds are all committed it scores
their decoded images with the run's training reward (only the leader builds reward models) and records
the unit exactly as a plain worker does, ``{"seeds", "rewards", "seconds"}``: the explored table does not
say who computed a unit. Two small collectives per seed keep the group in step: a MAX all-reduce of
"I got SIGTERM" flags, then the leader's command broadcast.

Every member holds the exploring policy theta_{t-1} as the base (loaded once per process) plus a
trainable state (with LoRA, the adapter): each seed command names the policy iteration, and a member
holding another loads that iteration's state from the run store before rolling out, so all members
hold the same state when a unit starts.

What happens when:

- **SIGTERM** (a spot preemption notice): the member finishes the seed in hand with the group; at the
  next seed boundary the flag stops the group, the leader releases the item (the unit in hand keeps
  its committed seeds), the member writes ``left/`` and exits, the others regroup.
- **kill -9 / a hung peer**: the next collective raises on the survivors (gloo: the dead peer's
  sockets reset; else after ``collective_timeout_seconds``); the leader, if it survived, releases the
  item; every survivor tears its process group down and regroups with the weights in its memory. The
  next leader claims the item again and continues the unit from its last committed seed (the images
  of the seeds it rolled out itself are still in its memory; others are decoded from their latents).
  If the leader died, the next leader frees the group's lease at once (``release_stale``).
- **a replacement arrives**: it builds the policy on ``meta`` and asks in; the leader sees it at the
  next unit boundary, and if the group can take a larger degree it regroups; the replacement gets
  every weight from rank 0 over the new process group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import threading
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from spotlight import exploration
from spotlight.config import Config, ConfigError, SequenceParallelSection, parse_overrides
from spotlight.cost import Ledger, Outcome
from spotlight.models.policy import DiffusionPolicy, build_policy
from spotlight.pool import default_poll_seconds, pool_done
from spotlight.queue_worker import LeaseKeeper, install_sigterm_handler
from spotlight.run import Run, compute_device, open_run, run_config
from spotlight.sampler import Rollout
from spotlight.sequence_parallel import context
from spotlight.sequence_parallel.commands import Command, Exit, Regroup, RollOut, Wait
from spotlight.sequence_parallel.rendezvous import Generation, Rendezvous
from spotlight.sequence_parallel.weights import share_weights, skeleton_policy
from spotlight.store import AlreadyExistsError, RunStore, bytes_to_tensors, json_bytes, sha256, tensors_to_bytes
from spotlight.work_queue import Claim, WorkQueue

log = logging.getLogger(__name__)

#: the run store's folder of SP groups: ``sp-groups/{group}/`` (see :mod:`.rendezvous`)
GROUPS = "sp-groups"
#: generations in a row that break before any seed is finished: a bug, not a preemption
MAX_BARREN_GENERATIONS = 5


def group_name(raw: str) -> str:
    """A store key and queue worker name: SKYPILOT_TASK_ID or a hostname may hold characters they do not allow."""
    return re.sub(r"[^A-Za-z0-9_=+-]", "-", raw)


def group_prefix(group: str) -> str:
    return f"{GROUPS}/{group}"


def seed_records(store: RunStore, queue: WorkQueue, unit: str) -> dict[int, dict[str, Any]]:
    """A unit's committed seeds by their index in its batch (``{queue}/seeds/{unit}/{k:04d}``)."""
    prefix = f"{queue.prefix}/seeds/{unit}"
    return {int(n): store.get_json(f"{prefix}/{n}") for n in store.list(prefix) if n.isdigit()}


def load_policy(cfg: Config, source: Literal["pretrained", "peer"], device: torch.device) -> DiffusionPolicy:
    """The member's policy at theta_0: from the pipeline folder, or a skeleton that a peer fills (``peer``)."""
    policy = skeleton_policy(cfg) if source == "peer" else build_policy(cfg, device)
    return policy.requires_grad_(False).eval()


class End(StrEnum):
    """How a generation ended (``end`` in its stats event)."""

    BROKEN = "broken"    # a collective raised: a peer died or hung
    LEAVE = "leave"      # this member got SIGTERM and leaves the group
    REGROUP = "regroup"  # the leader ended the generation to regroup
    EXIT = "exit"        # the run needs no more exploration


@dataclass
class MemberStats:
    """What one member did; timestamps are wall-clock (time.time()) so processes can be compared."""

    member: str
    group: str
    generations: list[dict[str, Any]] = field(default_factory=list)
    seeds: int = 0       # rollouts this process took part in
    committed: int = 0   # seeds it committed first, as leader
    recomputed: int = 0  # finished seeds it found committed already (work done twice; 0 unless a lease expired)
    units: int = 0       # units it recorded first, as leader
    items_completed: list[str] = field(default_factory=list)
    states_loaded: list[int] = field(default_factory=list)  # policy iterations whose state it read from the store
    weights_received: dict[str, Any] | None = None
    left: bool = False


@dataclass
class _Unit:
    """The leader's unit in hand: its committed seeds, and the images of those it rolled out itself."""

    t: int
    queue: WorkQueue
    claim: Claim
    name: str
    records: dict[int, dict[str, Any]]
    images: dict[int, tuple[str, torch.Tensor]]  # index -> (sha256 of its committed latent, decoded image)

    @property
    def seeds(self) -> list[int]:
        return self.claim.item["batches"][self.name]

    def next_index(self) -> int | None:
        return next((k for k in range(len(self.seeds)) if k not in self.records), None)


class Member:
    """One process of an elastic SP group exploring the run (see the module docstring)."""

    def __init__(self, run: Run, sp: SequenceParallelSection, group: str, member: str, policy: DiffusionPolicy,
                 has_weights: bool, device: torch.device, host: str | None = None,
                 stop: threading.Event | None = None, idle_exit_seconds: float = 0.0) -> None:
        context.check_mode(sp, device)
        self.run, self.cfg, self.store = run, run.cfg, run.store
        self.sp, self.policy, self.device = sp, policy, device
        self.group, self.member = group, member
        self.worker = f"sp-{group}"  # the lease holder: one name per group, so a new leader frees a dead one's
        self.stop = stop or threading.Event()
        self.idle_exit_seconds = idle_exit_seconds
        self.group_prefix = group_prefix(group)
        n_heads, lengths = context.heads(policy), context.sequence_lengths(policy)
        self.rdv = Rendezvous(self.store, self.group_prefix, member, sp,
                              lambda d: context.valid_degree(d, sp.mode, n_heads, lengths), host)
        self.has_weights = has_weights
        self.held: int | None = 0 if has_weights else None  # the policy iteration of its trainable state
        self.backend = context.resolve_backend(sp, device)
        self.comm_device = device if self.backend == "nccl" else torch.device("cpu")
        self.stats = MemberStats(member, group)
        self._drained: set[str] = set()  # exploration queues seen drained (they never reopen)
        self._idle_since = time.monotonic()
        # leader state
        self._helds: list[int] = []  # what every member of the generation holds
        self._claim: Claim | None = None
        self._claimed_at = 0.0
        self._t: int | None = None
        self._queue: WorkQueue | None = None
        self._unit: _Unit | None = None
        self._images: tuple[tuple[str, str], dict[int, tuple[str, torch.Tensor]]] | None = None  # outlives claims
        self._lease: LeaseKeeper | None = None  # renews the claim's lease while the leader holds it
        self._ledger = Ledger(self.store, group, "explorer", self.cfg.placement.explorer.price_per_hour,
                              os.environ.get("SPOTLIGHT_SLOT") or group)

    # -- lifecycle -------------------------------------------------------------------------------
    def work(self) -> dict[str, Any]:
        """Explore until the run's flow is over, no exploration is open for ``idle_exit_seconds``, or
        SIGTERM; returns (and stores) this member's stats."""
        self.rdv.announce(self.has_weights)
        self.rdv.start_heartbeat()
        barren = 0
        try:
            while True:
                gen = self.rdv.join(give_up=lambda: self.stop.is_set() or self._over())
                if gen is None:
                    break
                seeds_before = self.stats.seeds
                end = self._generation(gen)
                barren = barren + 1 if end == End.BROKEN and self.stats.seeds == seeds_before else 0
                if barren >= MAX_BARREN_GENERATIONS:
                    raise RuntimeError(f"{self.member}: {barren} generations in a row broke before finishing a "
                                       "seed; see the errors logged above")
                if end in (End.EXIT, End.LEAVE):
                    break
        finally:
            if self.stop.is_set():
                self.rdv.leave()
                self.stats.left = True
            self.rdv.stop_heartbeat()
            self.store.put_json(f"{self.group_prefix}/stats/{self.member}", asdict(self.stats))
        return asdict(self.stats)

    def _over(self) -> bool:
        """The run's flow is over, or no exploration has been open for ``idle_exit_seconds``."""
        if pool_done(self.store):
            return True
        if exploration.open_queues(self.run, self._drained):
            self._idle_since = time.monotonic()
            return False
        return time.monotonic() - self._idle_since >= self.idle_exit_seconds

    def _generation(self, gen: Generation) -> End:
        """Form the generation's process group, work in it, tear it down; how it ended."""
        rank = gen.rank(self.member)
        event: dict[str, Any] = {"number": gen.number, "rank": rank, "degree": gen.degree,
                                 "members": list(gen.members), "joined_at": time.time()}
        self.stats.generations.append(event)
        end = End.BROKEN
        try:
            self._form(gen, rank)
            event["formed_at"] = time.time()
            end = self._serve(gen, rank, event)
        except RuntimeError as e:  # torch.distributed errors are RuntimeErrors (DistError included)
            log.warning("%s: generation %d broke: %s", self.member, gen.number, str(e)[:300])
        finally:
            if self._claim is not None:  # finished seeds are committed; the next leader claims the item again
                self._end_claim(Outcome.PREEMPTED if end == End.LEAVE or self.stop.is_set() else Outcome.REGROUP)
            context.disable(self.policy.core)
            if dist.is_initialized():
                dist.destroy_process_group()
        event.update(ended_at=time.time(), end=end)
        return end

    def _form(self, gen: Generation, rank: int) -> None:
        store = dist.PrefixStore(f"generation-{gen.number}", self.rdv.connect(gen))
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=gen.degree,
                                timeout=datetime.timedelta(seconds=self.sp.collective_timeout_seconds))
        if gen.receivers:
            started = time.time()
            sent = share_weights(self.policy, 0, [gen.rank(m) for m in gen.receivers], self.device)
            if self.member in gen.receivers:
                self.stats.weights_received = {"from": gen.members[0], "bytes": sent, "generation": gen.number,
                                               "seconds": time.time() - started}
                self.has_weights = True
                self.rdv.announce(True)
        helds: list[int | None] = [None] * gen.degree
        dist.all_gather_object(helds, self.held)
        if self.held is None:  # a receiver holds the state rank 0 sent
            self.held = helds[0]
        self._helds = [helds[0] if h is None else h for h in helds]
        if gen.degree > 1:
            context.enable(self.policy.core, self.sp, gen.degree)
        if rank == 0:  # a dead leader's lease (same group name) frees its item now, not when it expires
            for _, queue in exploration.open_queues(self.run, self._drained):
                queue.release_stale(self.worker)
            self._ledger.idle_from = time.time()

    # -- inside a generation ---------------------------------------------------------------------
    def _serve(self, gen: Generation, rank: int, event: dict[str, Any]) -> End:
        leader = rank == 0
        while True:
            flag = torch.tensor([int(self.stop.is_set())], device=self.comm_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            box: list[Command | None] = [self._decide(gen, leaving=bool(flag.item())) if leader else None]
            dist.broadcast_object_list(box, src=0, device=self.comm_device)
            match box[0]:
                case RollOut() as cmd:
                    if "working_at" not in event:  # back to work: the group rolls out again
                        event["working_at"] = time.time()
                        if leader:  # for whoever watches the group (bench/elastic_sp.py times regroups by it)
                            self.store.put_json(f"{self.group_prefix}/working/{gen.number:06d}",
                                                {"at": event["working_at"]})
                    self._hold_policy(cmd.policy)
                    started = time.perf_counter()
                    result = exploration.exploration_rollout(self.cfg, self.policy, [cmd.prompt], [cmd.seed])
                    self.stats.seeds += 1
                    if leader:
                        self._commit_seed(cmd.index, result, gen, time.perf_counter() - started)
                case Wait(seconds=seconds):
                    time.sleep(seconds)
                case Regroup():
                    return End.LEAVE if self.stop.is_set() else End.REGROUP
                case Exit():
                    return End.EXIT
                case other:
                    raise TypeError(f"{self.member}: not a group command: {other!r}")

    def _hold_policy(self, iteration: int) -> None:
        """Hold theta_iteration: the base stays, the trainable state is read from the run store."""
        if self.held != iteration:
            state = self.run.policy_state(iteration)
            if state is None:  # the leader never asks for this (see _claim_next)
                raise RuntimeError(f"{self.member} holds theta_{self.held} and cannot go back to theta_0")
            self.policy.load_trainable_state(state)
            self.held = iteration
            self.stats.states_loaded.append(iteration)
        self._helds = [iteration] * len(self._helds)

    def _decide(self, gen: Generation, leaving: bool) -> Command:
        """The leader's next command for the group."""
        if self._claim is not None and self._lease.lost.is_set():
            self._end_claim(Outcome.LEASE_LOST)  # the lease expired and was taken over: its new holder finishes it
        if leaving:
            return Regroup("a member leaves")  # the item is released as the generation ends
        while True:
            if self._unit is not None:
                u = self._unit
                k = u.next_index()
                if k is not None:
                    return RollOut(exploration.policy_iteration(self.cfg, u.t), u.claim.item["prompt"], u.seeds[k],
                                   u.name, k)
                self._record_unit()
                if self._can_grow(gen):  # a unit boundary
                    return Regroup("waiting processes allow a larger degree")
                continue
            if self._claim is not None:
                pending = self._queue.pending_units(self._claim.item_id)
                if pending:
                    self._open_unit(pending[0])
                else:
                    self._end_claim(Outcome.OK)
                continue
            if self._can_grow(gen):
                return Regroup("waiting processes allow a larger degree")
            if not self._claim_next():
                if self._over():
                    return Exit()
                return Wait(max(default_poll_seconds(self.store), 0.1))

    def _can_grow(self, gen: Generation) -> bool:
        waiting = self.rdv.waiting(gen)
        if not waiting:
            return False
        n = min(gen.degree + len(waiting), self.sp.degree)
        return max(d for d in range(1, n + 1) if self.rdv.degree_ok(d)) > gen.degree

    def _claim_next(self) -> bool:
        """Claim an item of the oldest open exploration the group can explore."""
        for t, queue in exploration.open_queues(self.run, self._drained):
            if exploration.policy_iteration(self.cfg, t) == 0 and any(h != 0 for h in self._helds):
                continue  # theta_0 is no commit of the store: whoever moved past it cannot go back; plain workers can
            claim = queue.claim(self.worker)
            if claim is not None:
                self._t, self._queue, self._claim, self._claimed_at = t, queue, claim, time.time()
                self._lease = LeaseKeeper(queue, claim).start()
                return True
        return False

    def _end_claim(self, outcome: Outcome) -> None:
        """Complete (``ok``) or release the item (a lost lease: leave it to its new holder); the ledger gets
        the attempt."""
        claim, queue = self._claim, self._queue
        if outcome == Outcome.OK:
            if queue.complete(claim):
                self.stats.items_completed.append(claim.item_id)
        elif outcome != Outcome.LEASE_LOST:
            queue.release(claim)
        self._lease.stop()
        idle = max(0.0, self._claimed_at - self._ledger.idle_from)
        self._ledger.record("explore", self._t, time.time() - self._claimed_at, outcome, idle,
                            units=len(claim.recorded), degree=len(self._helds))
        self._claim, self._queue, self._t, self._unit, self._lease = None, None, None, None, None

    # -- the leader's seeds and units ----------------------------------------------------------------
    def _open_unit(self, name: str) -> None:
        """The unit's committed seeds from the store; the images this process kept of them, if any."""
        records = seed_records(self.store, self._queue, name)
        key = (self._queue.prefix, name)
        kept = self._images[1] if self._images is not None and self._images[0] == key else {}
        images = {k: v for k, v in kept.items() if k in records and records[k]["latent_sha256"] == v[0]}
        self._images = (key, images)
        self._unit = _Unit(self._t, self._queue, self._claim, name, records, images)

    def _commit_seed(self, index: int, result: Rollout, gen: Generation, seconds: float) -> None:
        """The seed's final latent (content-addressed, create-only), then its seed record: the commit point."""
        u = self._unit
        data = tensors_to_bytes({"latent": result.latents[0, -1].cpu()})
        digest = sha256(data)
        latent_key = f"{u.queue.prefix}/latents/{u.name}-{index:04d}-{digest[:16]}"
        try:
            self.store.create_bytes(latent_key, data)
        except AlreadyExistsError:
            pass
        record = {"seed": u.seeds[index], "latent": latent_key, "latent_sha256": digest,
                  "log_probs": result.log_probs[0].tolist(), "group": self.group, "generation": gen.number,
                  "degree": gen.degree, "members": list(gen.members), "seconds": seconds}
        key = f"{u.queue.prefix}/seeds/{u.name}/{index:04d}"
        try:
            self.store.create_bytes(key, json_bytes(record))
            self.stats.committed += 1
        except AlreadyExistsError:  # another leader committed it first: its numbers are kept
            record = self.store.get_json(key)
            self.stats.recomputed += 1
        u.records[index] = record
        if record["latent_sha256"] == digest:
            u.images[index] = (digest, result.images)

    def _record_unit(self) -> None:
        """Score the unit's images with the run's training reward and record it, as a plain worker does."""
        u = self._unit
        started = time.perf_counter()
        images = []
        for k in range(len(u.seeds)):
            if k in u.images:
                images.append(u.images[k][1])
            else:  # committed by another leader: decoded as the sampler decodes its final latent
                latent = bytes_to_tensors(self.store.read_bytes(u.records[k]["latent"]))["latent"]
                with torch.no_grad():
                    images.append(self.policy.decode(latent[None].to(self.device)))
        rewards = exploration.unit_rewards(self.run, torch.cat(images), u.claim.item["prompt"])
        seconds = sum(r["seconds"] for r in u.records.values()) + time.perf_counter() - started
        self.stats.units += u.queue.record(u.claim, {u.name: exploration.unit_result(u.seeds, rewards, seconds)})
        self._unit, self._images = None, None


def member_options(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of a member (and of the launcher that forks them)."""
    p.add_argument("--run", required=True, help="the run's store URL (file:// or s3://)")
    p.add_argument("--group", required=True, help="the group's name: the explorer it is (a pool slot, "
                   "SKYPILOT_TASK_ID); its lease holder is sp-<group>, its records are under sp-groups/<group>")
    p.add_argument("--sp", action="append", default=[],
                   help="override placement.sequence_parallel key=value (tests, benches)")
    p.add_argument("--weights", choices=["pretrained", "peer"], default="pretrained",
                   help="peer: build the policy on meta and receive every weight from a group member")
    p.add_argument("--pretrained", help="the pipeline folder on this machine (default: the run's model.pretrained)")
    p.add_argument("--host", help="address peers reach this process at (default: this host's)")
    p.add_argument("--device", default="auto", help="cpu, cuda (member i takes GPU i) or auto (the run's run.device)")
    p.add_argument("--idle-exit", type=float, default=0.0,
                   help="exit after this long with no open exploration (the flow's end always stops it)")
    return p


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotlight.sequence_parallel.member",
                                description="One member of an elastic sequence-parallel explorer group.")
    p.add_argument("--member", required=True, help="this process's name (unique in the group, per process life)")
    return member_options(p)


def member_device(name: str, index: int) -> torch.device:
    """Member ``index``'s device: GPU ``index`` if ``name`` is CUDA, else the CPU."""
    device = compute_device(name)
    if device.type != "cuda":
        return device
    if index >= torch.cuda.device_count():
        raise ConfigError(f"member {index} of an SP group needs GPU {index}, but this machine has "
                          f"{torch.cuda.device_count()}")
    return torch.device("cuda", index)


def run_from_args(args: argparse.Namespace, member: str, index: int = 0,
                  policy_hook: Callable[[DiffusionPolicy], None] | None = None) -> dict[str, Any]:
    """Open the run, load the policy and work as ``member`` (GPU ``index`` on CUDA) until done; SIGTERM
    makes it leave. ``policy_hook`` sees the policy before the member starts (tests inject faults there)."""
    cfg = run_config(args.run)
    device = member_device(cfg.run.device if args.device == "auto" else args.device, index)
    run = open_run(cfg, device=device)  # on CUDA it pins this GPU before any group forms (diffusers' mesh
    # would pick rank % GPUs otherwise, and a regrouped process keeps its GPU but gets another rank)
    sp = SequenceParallelSection(**{**run.cfg.placement.sequence_parallel.model_dump(), **parse_overrides(args.sp)})
    stop = threading.Event()
    install_sigterm_handler(stop)
    local = run.cfg if args.pretrained is None else run.cfg.model_copy(
        update={"model": run.cfg.model.model_copy(update={"pretrained": args.pretrained})})
    policy = load_policy(local, args.weights, device)
    if policy_hook is not None:
        policy_hook(policy)
    return Member(run, sp, group_name(args.group), member, policy, args.weights == "pretrained", device, args.host, stop,
                  args.idle_exit).work()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    stats = run_from_args(args, args.member)
    print(json.dumps({"member": args.member, "seeds": stats["seeds"], "units": stats["units"],
                      "generations": len(stats["generations"]), "left": stats["left"], "pid": os.getpid()}),
          flush=True)


if __name__ == "__main__":
    main()
