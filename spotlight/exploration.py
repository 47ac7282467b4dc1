"""Seed exploration: roll out many candidate seeds per prompt and record their rewards.

Mode ``spotlight`` explores iteration t's prompts with theta_{t-1} (stale by one) while update(t-1)
runs; mode ``sync`` explores with theta_t on the critical path; mode ``none`` explores nothing.
The work is published as a queue in the run store (see :mod:`spotlight.work_queue`): one item per
prompt, one unit per fixed batch of seeds. Batches never change composition, so a batch rolled out
again after a preemption gives bit-identical rewards, and the explored table of a faulty run equals
that of a clean one.
"""

from __future__ import annotations

import os
import socket
import time
from functools import partial
from typing import Any, Iterator

import torch

from spotlight.config import Config
from spotlight.sampler import sample_sde
from spotlight.seeding import SEED_SPACE, generator
from spotlight.work_queue import WorkQueue
from spotlight.worker import run_worker

QUEUE_PREFIX = "queues"


def policy_iteration(cfg: Config, t: int) -> int:
    """Which policy explores iteration t: theta_{t-1} (stale) in spotlight mode, theta_t in sync mode."""
    return max(t - 1, 0) if cfg.exploration.mode == "spotlight" else t


def queue_for(run, t: int) -> WorkQueue:
    return WorkQueue(run.store, f"{QUEUE_PREFIX}/explore-{t:04d}", lease_seconds=run.cfg.exploration.lease_seconds)


def open_queues(run) -> list[tuple[int, WorkQueue]]:
    """Published exploration queues that still have unfinished items, oldest first."""
    out = []
    for name in run.store.list(QUEUE_PREFIX):
        if name.startswith("explore-"):
            t = int(name.removeprefix("explore-"))
            queue = queue_for(run, t)
            if queue.published() and not queue.drained():
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


def rollout_rewards(run, policy, prompt: str, seeds: list[int], steps: int | None = None) -> list[float]:
    """Training rewards of SDE rollouts of ``prompt`` with these seeds, on the training rollout's noise
    path: with ``cfg.exploration_steps`` steps (the default: an exploration batch) or ``steps``."""
    cfg = run.cfg
    prompts = [prompt] * len(seeds)
    rollout = sample_sde(policy, prompts, seeds, steps or cfg.exploration_steps, cfg.sampler.noise_level,
                         cfg.sampler.guidance, brownian_steps=cfg.sampler.train_steps,
                         negative_prompt=cfg.sampler.negative_prompt)
    return run.weighted_reward("train")(rollout.images, prompts).tolist()


def explorer_id() -> str:
    """Which process rolled a unit out (host:pid): splits exploration seconds into the trainer's own and
    the workers' (core-seconds in bench/time_to_target.py)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def explore_units(run, t: int, item: dict[str, Any], units: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Roll out each unit's seed batch with the exploring policy; yield its rewards as soon as it is done."""
    policy = run.policy_at(policy_iteration(run.cfg, t))
    for unit in units:
        seeds = item["batches"][unit]
        started = time.perf_counter()
        rewards = rollout_rewards(run, policy, item["prompt"], seeds)
        yield unit, {"seeds": seeds, "rewards": rewards, "seconds": time.perf_counter() - started, "by": explorer_id()}


def explore_queue(run, t: int, queue: WorkQueue, items: list[dict[str, Any]], inline: bool) -> dict[str, Any]:
    """Publish the items and wait until they are explored by the workers, this process joining them
    when ``inline`` (a trainer that would otherwise sit idle waiting: the first spotlight iteration,
    every sync iteration, or no workers at all).

    A waiting stage that sees no progress for ``stall_seconds`` (every worker gone) works inline.
    """
    queue.publish(items)
    started = time.perf_counter()
    inline_stats: dict[str, Any] | None = None
    last_done, last_progress = -1, time.monotonic()
    while not queue.drained():
        if inline or time.monotonic() - last_progress > run.cfg.exploration.stall_seconds:
            inline_stats = run_worker(queue, partial(explore_units, run, t), worker_id="inline")
            continue
        done = queue.status()["units_done"]
        if done != last_done:
            last_done, last_progress = done, time.monotonic()
        time.sleep(0.05)
    return {"wall_seconds": time.perf_counter() - started, "inline": inline_stats is not None}


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
