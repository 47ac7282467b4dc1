"""Seed exploration: roll out many candidate seeds per prompt and record their rewards.

Mode ``spotlight`` explores iteration t's prompts with theta_{t-1} (stale by one) while update(t-1)
runs; mode ``sync`` explores with theta_t on the critical path; mode ``none`` explores nothing.
The work is published as a queue in the run store (see :mod:`spotlight.work_queue`): one item per
prompt, one unit per fixed batch of seeds. Batches never change composition, so a batch rolled out
again after a preemption gives bit-identical rewards, and the explored table of a faulty run equals
that of a clean one.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from functools import partial
from typing import Any, Iterator

import torch

from spotlight.config import Config
from spotlight.pool import WAITING, pacer, post_notice, saw_settled, seen_committed
from spotlight.queue_worker import run_worker
from spotlight.run import Run
from spotlight.sampler import Rollout, sample_sde
from spotlight.seeding import SEED_SPACE, generator
from spotlight.store import AlreadyExistsError, json_bytes
from spotlight.work_queue import WorkQueue

QUEUE_PREFIX = "queues"
#: seconds between two reads of the key that frees the trainers (``explore_queue``), a net: the update
#: that commits it is normally waited on by this same process, which then knows at no cost
JOIN_CHECK_EVERY = 15.0


def policy_iteration(cfg: Config, t: int) -> int:
    """Which policy explores iteration t: theta_{t-1} (stale) in spotlight mode, theta_t in sync mode."""
    return max(t - 1, 0) if cfg.exploration.mode == "spotlight" else t


def queue_for(run: Run, t: int) -> WorkQueue:
    return WorkQueue(run.store, f"{QUEUE_PREFIX}/explore-{t:04d}", lease_seconds=run.cfg.placement.lease_seconds)


def queue_named(run: Run, prefix: str) -> tuple[int, WorkQueue] | None:
    """The iteration and queue of an exploration queue's prefix (as a board notice names it), or None."""
    m = re.fullmatch(rf"{QUEUE_PREFIX}/explore-(\d{{4}})", prefix)
    return None if m is None else (int(m.group(1)), queue_for(run, int(m.group(1))))


def join_key(queue: WorkQueue) -> str:
    return f"{queue.prefix}/trainers-join.json"


def let_trainers_join(queue: WorkQueue, reason: str) -> None:
    """Trainers take this exploration's items too (they would sit idle otherwise, or the explorers are
    gone): the first reason is kept."""
    try:
        queue.store.create_bytes(join_key(queue), json_bytes({"reason": reason, "at": time.time()}))
    except AlreadyExistsError:
        return
    post_notice(queue.store, f"trainers may join {queue.prefix}", kind="join", prefix=queue.prefix)


def trainers_may_join(queue: WorkQueue) -> bool:
    return queue.store.exists(join_key(queue))


def open_queues(run: Run, final: set[str] | None = None,
                known: dict[str, WorkQueue] | None = None) -> list[tuple[int, WorkQueue]]:
    """Published exploration queues that still have unfinished items, oldest first. ``final`` caches the
    names of drained queues (they never reopen), so a long run's history is not re-read every poll;
    ``known`` the queues already seen (each remembers what it last saw: an unchanged one is one HEAD)."""
    final = set() if final is None else final
    known = {} if known is None else known
    out = []
    for name in run.store.list(QUEUE_PREFIX):
        if name.startswith("explore-") and name not in final:
            t = int(name.removeprefix("explore-"))
            queue = known.setdefault(name, queue_for(run, t))
            if queue.published():
                if queue.drained():
                    final.add(name)
                    known.pop(name, None)
                else:
                    out.append((t, queue))
    return out


def candidate_seeds(cfg: Config, t: int, counts: list[int]) -> list[list[int]]:
    """Seeded candidate seeds per prompt, one generator per (run seed, iteration, prompt index).

    Per-prompt generators pair the modes: a prompt's seeds never depend on the other prompts' counts,
    so every mode's first G seeds of prompt i are exactly the seeds mode ``none`` trains on for it,
    and the modes differ only in which seeds they select, not in which seeds they could draw.
    """
    return [torch.randint(SEED_SPACE, (n,), generator=generator(cfg.run.seed, "candidate-seeds", t, i)).tolist()
            for i, n in enumerate(counts)]


def make_items(prompts: list[str], seeds: list[list[int]], batch: int) -> list[dict[str, Any]]:
    items = []
    for i, (prompt, row) in enumerate(zip(prompts, seeds)):
        batches = {f"p{i:03d}-b{j:03d}": row[j * batch:(j + 1) * batch] for j in range(-(-len(row) // batch))}
        items.append({"id": f"p{i:03d}", "prompt_index": i, "prompt": prompt, "units": sorted(batches),
                      "batches": batches})
    return items


def exploration_rollout(cfg: Config, policy, prompts: list[str], seeds: list[int], steps: int | None = None) -> Rollout:
    """SDE rollouts on the training rollout's noise path, with ``cfg.exploration_steps`` steps (an
    exploration) or ``steps``: what a plain worker rolls out per batch and an SP group per seed."""
    return sample_sde(policy, prompts, seeds, steps or cfg.exploration_steps, cfg.sampler.noise_level,
                      cfg.sampler.guidance, brownian_steps=cfg.sampler.train_steps,
                      negative_prompt=cfg.sampler.negative_prompt)


def unit_rewards(run: Run, images: torch.Tensor, prompt: str) -> list[float]:
    """Training rewards of one prompt's images, scored as one batch (a unit's, whoever rolled it out)."""
    return run.weighted_reward("train")(images, [prompt] * len(images)).tolist()


def unit_result(seeds: list[int], rewards: list[float], seconds: float, role: str = "explorer") -> dict[str, Any]:
    """What the queue records for a unit: the same record from a plain worker and an SP group (``by``:
    who rolled it out, so exploration seconds split into the trainers' own and the explorers')."""
    return {"seeds": seeds, "rewards": rewards, "seconds": seconds, "by": explorer_id(role)}


def rollout_rewards(run: Run, policy, prompt: str, seeds: list[int], steps: int | None = None) -> list[float]:
    """Training rewards of SDE rollouts of ``prompt`` with these seeds, on the training rollout's noise
    path: with ``cfg.exploration_steps`` steps (the default: an exploration batch) or ``steps``."""
    return unit_rewards(run, exploration_rollout(run.cfg, policy, [prompt] * len(seeds), seeds, steps).images, prompt)


def explorer_id(role: str) -> str:
    """Which process rolled a unit out, and in which role (``explorer``, ``trainer``, ``inline``):
    ``role@host:pid``. Splits exploration seconds into the trainers' own and the explorers' (core-seconds
    in bench/time_to_target.py)."""
    return f"{role}@{socket.gethostname()}:{os.getpid()}"


def role_of(explorer: str) -> str:
    """The role part of an :func:`explorer_id`."""
    return explorer.partition("@")[0]


def explore_units(run: Run, t: int, item: dict[str, Any], units: list[str],
                  role: str = "explorer") -> Iterator[tuple[str, dict[str, Any]]]:
    """Roll out each unit's seed batch with the exploring policy; yield its rewards as soon as it is done.
    ``role``: who explores (an explorer, a trainer that joined, or the stage's own process: ``inline``)."""
    policy = run.policy_at(policy_iteration(run.cfg, t))
    for unit in units:
        seeds = item["batches"][unit]
        started = time.perf_counter()
        rewards = rollout_rewards(run, policy, item["prompt"], seeds)
        yield unit, unit_result(seeds, rewards, time.perf_counter() - started, role)


def explore_queue(run: Run, t: int, queue: WorkQueue, items: list[dict[str, Any]], inline: bool,
                  trainers_join: bool | str = False) -> dict[str, Any]:
    """Publish the items and wait until they are explored.

    ``inline``: this process explores too (a library call with no worker pool: ``spotlight stage``).
    Otherwise the run's workers do it all and this process only waits (the flow's controller never
    computes): the explorers take every item; the trainers join when ``trainers_join`` is True (the flow
    waits for this exploration and the trainer would idle: the first spotlight iteration, every sync
    iteration, no explorers at all), or a store key that, once committed, frees the trainer (spotlight:
    the update that runs meanwhile). A waiting stage that sees no progress for
    ``placement.stall_seconds`` (every explorer gone) lets the trainers join, wherever they run.
    """
    queue.publish(items)
    post_notice(run.store, f"published {queue.prefix}", kind="exploration", prefix=queue.prefix)
    started = time.perf_counter()
    inline_stats: dict[str, Any] | None = None
    joined = trainers_join is True
    if joined:
        let_trainers_join(queue, "the flow waits for this exploration")
    last_progress, pace, join_checked = time.monotonic(), pacer(run.store), -math.inf
    with WAITING.waiting():
        if queue.just_published and not inline:  # published just now: nothing can be done yet
            time.sleep(pace.next())
        while True:
            changed, drained = queue.look()  # one GET
            if drained:
                saw_settled(run.store, queue.prefix)
                break
            if inline:
                inline_stats = run_worker(queue, partial(explore_units, run, t, role="inline"), worker_id="inline")
                continue
            if changed:
                last_progress = time.monotonic()
                pace.reset()
                if queue.last_event == "released":  # a preempted worker handed an item back: tell the others
                    post_notice(run.store, f"an item of {queue.prefix} handed back", kind="freed", prefix=queue.prefix)
            if not joined and isinstance(trainers_join, str) and (seen_committed(run.store, trainers_join) or (
                    time.monotonic() - join_checked >= JOIN_CHECK_EVERY)):
                join_checked = time.monotonic()  # one HEAD unless this process saw the commit made
                if seen_committed(run.store, trainers_join) or run.store.is_committed(trainers_join):
                    let_trainers_join(queue, f"{trainers_join} is committed: the trainer is free")
                    joined = True
            if not joined and time.monotonic() - last_progress > run.cfg.placement.stall_seconds:
                let_trainers_join(queue, f"no progress for {run.cfg.placement.stall_seconds:g} s")
                joined = True
            time.sleep(pace.next())
    return {"wall_seconds": time.perf_counter() - started, "inline": inline_stats is not None,
            "trainers_joined": joined}


def gather(queue: WorkQueue, items: list[dict[str, Any]]) -> tuple[list[list[int]], list[list[float]], dict[str, float]]:
    """The explored table in candidate order, and the rollout seconds spent on it per explorer (host:pid)."""
    results = queue.results()
    seeds, rewards, seconds = [], [], {}
    for item in items:
        row_s, row_r = [], []
        for unit in item["units"]:
            r = results[unit]
            row_s += r["seeds"]
            row_r += r["rewards"]
            by = r.get("by", "unknown")
            seconds[by] = seconds.get(by, 0.0) + r["seconds"]
        seeds.append(row_s)
        rewards.append(row_r)
    return seeds, rewards, seconds


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(x: list[float]) -> torch.Tensor:
        v = torch.tensor(x, dtype=torch.float64)
        order = torch.argsort(v, stable=True)
        r = torch.empty_like(v)
        r[order] = torch.arange(len(v), dtype=torch.float64)
        for value in v.unique():  # average the ranks of ties
            tie = v == value
            r[tie] = r[tie].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = (ra.norm() * rb.norm()).item()
    return float((ra @ rb).item() / denom) if denom > 0 else 1.0
