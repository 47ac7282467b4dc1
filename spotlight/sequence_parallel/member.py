"""A member of an elastic sequence-parallel group: one persistent process per GPU, holding the policy.

The members of a generation (see :mod:`.rendezvous`) roll out each image together: every member runs
the same SDE sampler (:func:`spotlight.sampler.sample_sde`, noise drawn from the seed's CPU
generator, so the same numbers on every member) and the transformer's forward is sharded along the
sequence by diffusers' context parallelism, its output all-gathered. Rank 0 leads: it holds the
work-queue lease, picks the next seed, and commits each finished seed at once (its final latent as a
content-addressed object, then the queue unit, create-only). Two small collectives per seed keep the
group in step: a MAX all-reduce of "I got SIGTERM" flags, then the leader's command broadcast.

What happens when:

- **SIGTERM** (a spot preemption notice): the member finishes the seed in hand with the group; at the
  next seed boundary the flag stops the group, the leader releases the item (its finished seeds are
  committed, the rest re-queued), the member writes ``left/`` and exits, the others regroup.
- **kill -9 / a hung peer**: the next collective raises on the survivors (gloo: the dead peer's
  sockets reset; else after ``collective_timeout_seconds``); the leader, if it survived, releases the
  item; every survivor tears its process group down and regroups with the weights in its memory. If
  the leader died, its seeds are committed up to the last finished one and the item returns to the
  queue when its lease expires.
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
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist

from spotlight.config import Config, SequenceParallelSection, load_config, parse_overrides
from spotlight.models.policy import DiffusionPolicy, build_policy
from spotlight.sampler import Rollout, sample_sde
from spotlight.sequence_parallel import context
from spotlight.sequence_parallel.rendezvous import Generation, Rendezvous
from spotlight.sequence_parallel.weights import share_weights, skeleton_policy
from spotlight.store import AlreadyExistsError, RunStore, sha256, tensors_to_bytes
from spotlight.work_queue import Claim, WorkQueue
from spotlight.worker import _heartbeat as keep_lease, install_sigterm_handler

log = logging.getLogger(__name__)

#: generations in a row that break before any seed is finished: a bug, not a preemption
MAX_BARREN_GENERATIONS = 5


def make_items(prompts: list[str], seeds: list[list[int]], seeds_per_item: int) -> list[dict[str, Any]]:
    """Work items for an SP group: an item is a fixed batch of one prompt's seeds, a unit one seed."""
    items = []
    for i, (prompt, row) in enumerate(zip(prompts, seeds)):
        for j in range(0, len(row), seeds_per_item):
            units = {f"p{i:03d}-n{k:04d}": int(row[k]) for k in range(j, min(j + seeds_per_item, len(row)))}
            items.append({"id": f"p{i:03d}-i{j // seeds_per_item:03d}", "prompt": prompt, "units": list(units),
                          "seeds": units})
    return items


def rollout(policy: DiffusionPolicy, cfg: Config, prompt: str, seed: int) -> Rollout:
    """One seed's exploration rollout, exactly as :func:`spotlight.exploration.rollout_rewards` samples it."""
    return sample_sde(policy, [prompt], [seed], cfg.exploration_steps, cfg.sampler.noise_level, cfg.sampler.guidance,
                      brownian_steps=cfg.sampler.train_steps, negative_prompt=cfg.sampler.negative_prompt)


def load_policy(cfg: Config, source: Literal["pretrained", "peer"], device: torch.device,
                store: RunStore | None = None, commit: str | None = None) -> DiffusionPolicy:
    """The member's policy: from the pipeline folder (plus theta_t's trainable state from a run-store
    ``commit`` holding ``policy.safetensors``), or a skeleton that a peer fills (``peer``)."""
    if source == "peer":
        return skeleton_policy(cfg).requires_grad_(False).eval()
    policy = build_policy(cfg, device)
    if commit is not None:
        policy.load_trainable_state(store.load(commit).tensors("policy.safetensors"))
    return policy.requires_grad_(False).eval()


@dataclass
class MemberStats:
    """What one member did; timestamps are wall-clock (time.time()) so processes can be compared."""

    member: str
    generations: list[dict[str, Any]] = field(default_factory=list)
    seeds: int = 0       # rollouts this process took part in
    committed: int = 0   # seeds it committed as leader
    recomputed: int = 0  # finished seeds it found committed already (work done twice; 0 unless a lease expired)
    weights_received: dict[str, Any] | None = None
    left: bool = False


class Member:
    """One process of an elastic SP group working on ``queue`` (see the module docstring)."""

    def __init__(self, cfg: Config, sp: SequenceParallelSection, store: RunStore, queue_prefix: str,
                 group_prefix: str, member: str, policy: DiffusionPolicy, has_weights: bool,
                 device: torch.device, host: str | None = None, stop: threading.Event | None = None) -> None:
        context.check_mode(sp, device)
        self.cfg, self.sp, self.store, self.policy, self.device = cfg, sp, store, policy, device
        self.member = member
        self.stop = stop or threading.Event()
        self.queue = WorkQueue(store, queue_prefix, lease_seconds=cfg.placement.lease_seconds)
        self.group_prefix = group_prefix.strip("/")
        n_heads, lengths = context.heads(policy), context.sequence_lengths(policy)
        self.rdv = Rendezvous(store, group_prefix, member, sp,
                              lambda d: context.valid_degree(d, sp.mode, n_heads, lengths), host)
        self.has_weights = has_weights
        self.backend = context.resolve_backend(sp, device)
        self.comm_device = device if self.backend == "nccl" else torch.device("cpu")
        self.stats = MemberStats(member)
        # leader state
        self._claim: Claim | None = None
        self._pending: list[str] = []
        self._lease_lost = threading.Event()
        self._lease_stop = threading.Event()
        self._lease_keeper: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """Work until the queue is drained or SIGTERM; returns (and stores) this member's stats."""
        self.rdv.announce(self.has_weights)
        self.rdv.start_heartbeat()
        barren = 0
        try:
            while True:
                gen = self.rdv.join(give_up=lambda: self.stop.is_set() or self.queue.drained())
                if gen is None:
                    break
                seeds_before = self.stats.seeds
                end = self._generation(gen)
                barren = barren + 1 if end == "broken" and self.stats.seeds == seeds_before else 0
                if barren >= MAX_BARREN_GENERATIONS:
                    raise RuntimeError(f"{self.member}: {barren} generations in a row broke before finishing a "
                                       "seed; see the errors logged above")
                if end in ("drained", "leave"):
                    break
        finally:
            if self.stop.is_set():
                self.rdv.leave()
                self.stats.left = True
            self.rdv.stop_heartbeat()
            self.store.put_json(f"{self.group_prefix}/stats/{self.member}", asdict(self.stats))
        return asdict(self.stats)

    def _generation(self, gen: Generation) -> str:
        """Form the generation's process group, work in it, tear it down; how it ended."""
        rank = gen.rank(self.member)
        event: dict[str, Any] = {"number": gen.number, "rank": rank, "degree": gen.degree,
                                 "members": list(gen.members), "joined_at": time.time()}
        self.stats.generations.append(event)
        try:
            self._form(gen, rank)
            event["formed_at"] = time.time()
            end = self._serve(gen, rank, event)
        except RuntimeError as e:  # torch.distributed errors are RuntimeErrors (DistError included)
            log.warning("%s: generation %d broke: %s", self.member, gen.number, str(e)[:300])
            if self._claim is not None:  # finished seeds are committed; hand the rest back now
                self.queue.release(self._claim)
                self._drop_claim()
            end = "broken"
        finally:
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
        if gen.degree > 1:
            context.enable(self.policy.core, self.sp, gen.degree)

    # -- inside a generation ---------------------------------------------------------------------
    def _serve(self, gen: Generation, rank: int, event: dict[str, Any]) -> str:
        leader = rank == 0
        while True:
            flag = torch.tensor([int(self.stop.is_set())], device=self.comm_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            box = [self._decide(gen, leaving=bool(flag.item())) if leader else None]
            dist.broadcast_object_list(box, src=0, device=self.comm_device)
            cmd = box[0]
            if cmd["op"] == "seed":
                if "working_at" not in event:  # back to work: the group rolls out again
                    event["working_at"] = time.time()
                    if leader:  # for whoever watches the group (bench/elastic_sp.py times regroups by it)
                        self.store.put_json(f"{self.group_prefix}/working/{gen.number:06d}",
                                            {"at": event["working_at"]})
                started = time.perf_counter()
                result = rollout(self.policy, self.cfg, cmd["prompt"], cmd["seed"])
                self.stats.seeds += 1
                if leader:
                    self._commit(cmd, result, gen, time.perf_counter() - started)
            elif cmd["op"] == "wait":
                time.sleep(cmd["seconds"])
            elif cmd["op"] == "regroup" and self.stop.is_set():
                return "leave"
            else:
                return cmd["op"]  # regroup | drained

    def _decide(self, gen: Generation, leaving: bool) -> dict[str, Any]:
        """The leader's next command for the group."""
        if self._claim is not None and self._lease_lost.is_set():
            self._drop_claim()  # the lease expired and was taken over: its new holder finishes the item
        if leaving:
            if self._claim is not None:
                self.queue.release(self._claim)
                self._drop_claim()
            return {"op": "regroup", "why": "a member leaves"}
        while True:
            if self._claim is not None and self._pending:
                unit = self._pending.pop(0)
                item = self._claim.item
                return {"op": "seed", "item": item["id"], "unit": unit, "prompt": item["prompt"],
                        "seed": item["seeds"][unit]}
            if self._claim is not None:  # a unit boundary: the item is finished
                self.queue.complete(self._claim)
                self._drop_claim()
            if self._can_grow(gen):
                return {"op": "regroup", "why": "waiting processes allow a larger degree"}
            claim = self.queue.claim(f"sp-{self.member}")
            if claim is None:
                return {"op": "drained"} if self.queue.drained() else {"op": "wait", "seconds": 0.5}
            self._hold(claim)

    def _can_grow(self, gen: Generation) -> bool:
        waiting = self.rdv.waiting(gen)
        if not waiting:
            return False
        n = min(gen.degree + len(waiting), self.sp.degree)
        return max(d for d in range(1, n + 1) if self.rdv.degree_ok(d)) > gen.degree

    def _hold(self, claim: Claim) -> None:
        self._claim, self._pending = claim, self.queue.pending_units(claim.item_id)
        self._lease_lost.clear()
        self._lease_stop.clear()
        self._lease_keeper = threading.Thread(target=keep_lease, args=(self.queue, claim, self._lease_lost,
                                                                      self._lease_stop), daemon=True)
        self._lease_keeper.start()

    def _drop_claim(self) -> None:
        self._lease_stop.set()
        if self._lease_keeper is not None:
            self._lease_keeper.join()
        self._claim, self._pending, self._lease_keeper = None, [], None

    def _commit(self, cmd: dict[str, Any], result: Rollout, gen: Generation, seconds: float) -> None:
        """The seed's final latent (content-addressed, create-only), then its queue unit: the commit point."""
        data = tensors_to_bytes({"latent": result.latents[0, -1]})
        digest = sha256(data)
        key = f"{self.queue.prefix}/latents/{cmd['unit']}-{digest[:16]}"
        try:
            self.store.create_bytes(key, data)
        except AlreadyExistsError:
            pass
        new = self.queue.record(self._claim, {cmd["unit"]: {
            "seed": cmd["seed"], "log_probs": result.log_probs[0].tolist(), "latent": key, "latent_sha256": digest,
            "generation": gen.number, "degree": gen.degree, "members": list(gen.members), "seconds": seconds}})
        self.stats.committed += new
        self.stats.recomputed += 1 - new


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m spotlight.sequence_parallel.member",
                                description="One member of an elastic sequence-parallel group.")
    p.add_argument("--store", required=True, help="run store URL (file:// or s3://)")
    p.add_argument("--queue", required=True, help="the work queue's prefix in the store")
    p.add_argument("--group", required=True, help="the SP group's prefix in the store")
    p.add_argument("--member", required=True, help="this process's name (unique in the group)")
    p.add_argument("--config", help="run config YAML (model, sampler)")
    p.add_argument("--set", action="append", default=[], help="run config override section.key=value")
    p.add_argument("--sp", action="append", default=[], help="sequence_parallel setting key=value")
    p.add_argument("--weights", choices=["pretrained", "peer"], default="pretrained",
                   help="peer: build the policy on meta and receive every weight from a group member")
    p.add_argument("--policy-commit", help="run-store commit with theta_t's policy.safetensors")
    p.add_argument("--host", help="address peers reach this process at (default: this host's)")
    p.add_argument("--device", default="cpu")
    return p


def run_from_args(args: argparse.Namespace, member: str, device: torch.device,
                  policy_hook: Callable[[DiffusionPolicy], None] | None = None) -> dict[str, Any]:
    """Load the policy and work as ``member`` on ``device`` until done; SIGTERM makes it leave.
    ``policy_hook`` sees the policy before the member starts (tests inject faults there)."""
    cfg = load_config(args.config, args.set)
    torch.set_num_threads(cfg.run.threads)
    sp = SequenceParallelSection(**parse_overrides(args.sp))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any group: diffusers' mesh would pick rank % GPUs otherwise
    stop = threading.Event()
    install_sigterm_handler(stop)
    store = RunStore(args.store)
    policy = load_policy(cfg, args.weights, device, store, args.policy_commit)
    if policy_hook is not None:
        policy_hook(policy)
    return Member(cfg, sp, store, args.queue, args.group, member, policy, args.weights == "pretrained", device,
                  args.host, stop).run()


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    stats = run_from_args(args, args.member, torch.device(args.device))
    print(json.dumps({"member": args.member, "seeds": stats["seeds"], "generations": len(stats["generations"]),
                      "left": stats["left"], "pid": os.getpid()}), flush=True)


if __name__ == "__main__":
    main()
