"""The stages of a run as pure, idempotent functions: each computes its step once and commits it.

Calling a stage whose step is committed returns the commit without computing anything (one
prologue for all: :func:`committed_stage`), so a restarted flow (after kill -9, preemption or a
Prefect retry) resumes from the last commit; all randomness is derived from (run seed, stage,
iteration), so the resumed run is bit-identical.

Iteration t uses policy theta_t (theta_0 = the base):
    explore(t) -> filter(t) -> update(t) commits theta_{t+1};  evaluate(t) scores theta_t.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
from accelerate import Accelerator

from spotlight import checkpoints, exploration
from spotlight.data import other_half
from spotlight.ema import WeightsEMA, ema_state, weights_swapped
from spotlight.filter import keep_most_informative
from spotlight.grpo import UpdateBatch, grpo_epoch, recipe_advantages
from spotlight.planner import PlannerState, plan_exploration
from spotlight.pretrain import (BaseTrainer, classifier_accuracy, load_optimizer_tensors, optimizer_tensors,
                                train_classifier)
from spotlight.prompts import evaluation_prompts, iteration_prompts, reward_by_tag
from spotlight.quality import quality_metrics
from spotlight.run import Run, distributed
from spotlight.sampler import Rollout, encode_conditioning, sample_ode_batched, sample_sde_batched
from spotlight.seeding import derive_seed, generator
from spotlight.store import Commit, json_bytes, tensors_to_bytes

Stage = Callable[..., Commit]


def committed_stage(key: Callable[[Run, int], str]) -> Callable[[Stage], Stage]:
    """A stage's prologue: if its step is committed, return the commit; else compute and commit it."""
    def wrap(compute: Stage) -> Stage:
        @functools.wraps(compute)
        def stage(run: Run, t: int, *args: Any, **kwargs: Any) -> Commit:
            name = key(run, t)
            if run.store.is_committed(name):
                return run.store.load(name)
            return compute(run, t, name, *args, **kwargs)
        return stage
    return wrap


def iteration_key(stage: str) -> Callable[[Run, int], str]:
    return lambda run, t: run.key(stage, t)


# -- pretrain ----------------------------------------------------------------------------------
CLASSIFIERS = {"reward_classifier": ("a", 16, 1), "eval_classifier": ("b", 12, 2)}  # data half, width, seed
DIGIT_REWARDS = ("digit_classifier", "heldout_classifier")


def train_digit_classifiers(run: Run) -> None:
    """The digit reward classifiers, each on its half of the digits, cached (when a digit reward is used)."""
    cfg, cache = run.cfg, run.cache
    if set(DIGIT_REWARDS) & set(cfg.rewards.names()) and not cache.is_committed(run.classifiers_key):
        objects, meta = {}, {}
        for name, (part, width, seed) in CLASSIFIERS.items():
            model = train_classifier(part, width, cfg.pretrain.classifier_steps, derive_seed(cfg.run.seed, name, seed),
                                     lambda d, n, _s, name=name: run.progress(f"train {name}", d, n))
            objects[f"{name}.safetensors"] = tensors_to_bytes(model.state_dict())
            meta[name] = {"width": width, "trained_on": part,
                          "accuracy_on_other_half": classifier_accuracy(model, other_half(part))}
        cache.commit(run.classifiers_key, objects, meta)


def pretrain(run: Run) -> Commit | None:
    """What the run needs trained before RL, cached: the digit reward classifiers (when a digit reward
    is used) and the tiny base policy (EMA weights), resumable in chunks. Pipelines arrive pretrained."""
    cfg, cache = run.cfg, run.cache
    train_digit_classifiers(run)
    if not run.pretrains_base:
        return None
    final = f"{run.base_key}/final"
    if cache.is_committed(final):
        return cache.load(final)
    trainer = BaseTrainer(cfg)
    chunks = sorted(k for k in cache.list(run.base_key) if k.startswith("step-") and cache.is_committed(f"{run.base_key}/{k}"))
    if chunks:
        trainer.load(cache.load(f"{run.base_key}/{chunks[-1]}").tensors("state.safetensors"), int(chunks[-1][5:]))
    started = time.perf_counter()
    while trainer.step < cfg.pretrain.steps:
        until = min(cfg.pretrain.steps, (trainer.step // cfg.pretrain.commit_every + 1) * cfg.pretrain.commit_every)
        trainer.train(until, lambda d, n, _s: run.progress("pretrain base", d, n))
        cache.commit(f"{run.base_key}/step-{trainer.step:07d}", {"state.safetensors": tensors_to_bytes(trainer.state())})
    ema = trainer.ema.trainable_state()
    return cache.commit(final, {"ema.safetensors": tensors_to_bytes(ema)},
                        {"steps": cfg.pretrain.steps, "seconds_last_session": time.perf_counter() - started})


# -- explore / filter -------------------------------------------------------------------------
@committed_stage(iteration_key("explore"))
def explore(run: Run, t: int, key: str, pool: bool = False, trainers_join: bool | str = False) -> Commit:
    """Candidate seeds (and, when exploring, their rewards) for iteration t's prompts.

    Mode ``none``: G random seeds per prompt, nothing rolled out. Otherwise the planner sizes the
    exploration, the work goes through the run's queue, and the explored table is committed.
    ``pool``: the run's workers explore and this process (the flow's controller) only plans, waits and
    gathers; ``trainers_join`` says when the trainers join the explorers (see
    ``exploration.explore_queue``). Without a pool this process explores, alongside any workers.
    Who computed a unit never changes its result, so this changes timings, not numbers.
    """
    cfg, ec = run.cfg, run.cfg.exploration
    prompts = iteration_prompts(cfg, t)
    if ec.mode == "none":
        seeds = exploration.candidate_seeds(cfg, t, [cfg.grpo.group_size] * len(prompts))
        table = {"prompts": prompts, "seeds": seeds, "rewards": None}
        return run.store.commit(key, {"explored.json": json_bytes(table)}, {"mode": ec.mode})
    decision = plan_exploration(cfg, t, prompts, planner_state(run, t))
    seeds = exploration.candidate_seeds(cfg, t, decision["counts"])
    items = exploration.make_items(prompts, seeds, ec.seeds_per_batch)
    if pool and cfg.placement.explorer.workers == 0:
        trainers_join = True  # no explorers: the trainers explore
    queue = exploration.queue_for(run, t)  # one object: its caches of items and results serve gather too
    waited = exploration.explore_queue(run, t, queue, items, inline=not pool, trainers_join=trainers_join)
    seeds, rewards, by_explorer = exploration.gather(queue, items)
    rollout_seconds = sum(by_explorer.values())
    own = sum(s for by, s in by_explorer.items() if exploration.role_of(by) != "explorer")  # trainers' (and inline)
    explorers = (cfg.placement.explorer.workers if pool else 0) + \
        (cfg.placement.trainer.workers if waited["trainers_joined"] else 0) + (0 if pool else 1)
    stats = {**waited, "rollout_seconds": rollout_seconds, "candidates": sum(map(len, seeds)),
             "trainer_rollout_seconds": own, "worker_rollout_seconds": rollout_seconds - own,
             "policy_iteration": exploration.policy_iteration(cfg, t), "explorers": explorers,
             "worker_utilisation": rollout_seconds / max(waited["wall_seconds"], 1e-9) / max(explorers, 1)}
    table = {"prompts": prompts, "seeds": seeds, "rewards": rewards}
    return run.store.commit(key, {"explored.json": json_bytes(table), "plan.json": json_bytes(decision),
                                  "stats.json": json_bytes(stats)}, {"mode": ec.mode})


def planner_state(run: Run, t: int) -> PlannerState:
    """The bandit's posteriors from every committed filter before t (the same set on every resume)."""
    state = PlannerState()
    for s in range(t):
        state.forget()  # once per iteration: old evidence fades as the policy moves
        if run.store.is_committed(run.key("filter", s)):
            for row in run.store.load(run.key("filter", s)).json("stats.json").get("prompts", []):
                state.observe(row["prompt"], row["candidates_std"], row["candidates"])
    return state


@committed_stage(iteration_key("filter"))
def filter_seeds(run: Run, t: int, key: str) -> Commit:
    """The G seeds per prompt that go into update(t): the max-variance subset of the explored candidates,
    for the prompt groups with the most variance."""
    explored = explore(run, t).json("explored.json")
    cfg, g = run.cfg, run.cfg.grpo.group_size
    if explored["rewards"] is None:
        chosen = {"prompts": explored["prompts"], "seeds": [s[:g] for s in explored["seeds"]]}
        return run.store.commit(key, {"filtered.json": json_bytes(chosen), "stats.json": json_bytes({})})
    kept, stats = keep_most_informative(explored["prompts"], explored["seeds"], explored["rewards"], g,
                                        cfg.grpo.prompts_per_iteration, cfg.exploration.min_std,
                                        select_seeds=cfg.exploration.select != "prompts",
                                        variance_seeds=cfg.exploration.variance_seeds,
                                        variance_groups=cfg.exploration.variance_groups)
    return run.store.commit(key, {"filtered.json": json_bytes(kept), "stats.json": json_bytes(stats)})


@committed_stage(iteration_key("ranking"))
def ranking_check(run: Run, t: int, key: str) -> Commit:
    """Do seed rankings survive one stale iteration? Re-roll iteration t's explored candidates of a few
    prompts with fresh theta_t and correlate (Spearman) with the rewards explored under theta_{t-1}:
    ``spearman`` at exploration fidelity (staleness alone), ``spearman_to_training`` against fresh
    full-step rollouts (staleness and coarsening together: what the update will see)."""
    explored = explore(run, t)
    table, stale_at = explored.json("explored.json"), explored.json("stats.json")["policy_iteration"]
    items = exploration.make_items(table["prompts"], table["seeds"], run.cfg.exploration.seeds_per_batch)
    fresh = run.policy_at(t)
    rows = []
    for item, stale in list(zip(items, table["rewards"]))[: run.cfg.exploration.ranking_prompts]:
        def rerolled(steps: int | None = None) -> list[float]:
            return [r for unit in item["units"]
                    for r in exploration.rollout_rewards(run, fresh, item["prompt"], item["batches"][unit], steps)]
        rewards = rerolled()
        training = rerolled(run.cfg.sampler.train_steps) if run.cfg.exploration.coarsen > 1 else rewards
        rows.append({"prompt": item["prompt"], "n": len(rewards), "spearman": exploration.spearman(stale, rewards),
                     "spearman_to_training": exploration.spearman(stale, training)})
    result = {"iteration": t, "stale_policy": stale_at, "fresh_policy": t, "prompts": rows,
              "coarsen": run.cfg.exploration.coarsen,
              "spearman": sum(r["spearman"] for r in rows) / len(rows),
              "spearman_to_training": sum(r["spearman_to_training"] for r in rows) / len(rows)}
    return run.store.commit(key, {"metrics.json": json_bytes(result)})


# -- update -----------------------------------------------------------------------------------
def sharded_rollouts(run: Run, policy, reward, prompts: list[str], seeds: list[int], groups: int,
                     accelerator: Accelerator | None) -> tuple[Rollout, dict[str, torch.Tensor], int]:
    """The update's SDE rollouts and reward components, in prompt-group order, and how many processes
    shared them.

    Data parallel (``accelerator`` with several processes): rank r rolls out and scores the r-th
    contiguous block of prompt groups, and the ranks all-gather them, so N processes share the
    rollouts as a user of N GPUs would (each seed's noise is its own, so a sample is the same
    experiment on whichever rank; the numbers differ from one process's only in the last bits, as
    CPU matmuls are not batch-invariant). With fewer groups than ranks every rank rolls out all.
    """
    sc = run.cfg.sampler
    world = accelerator.num_processes if accelerator is not None else 1
    if world == 1 or groups < world:
        rollout = sample_sde_batched(policy, prompts, seeds, sc.batch_size, steps=sc.train_steps,
                                     noise_level=sc.noise_level, guidance=sc.guidance,
                                     negative_prompt=sc.negative_prompt)
        return rollout, reward.components(rollout.images, prompts), 1
    per_group = len(prompts) // groups
    block = torch.tensor_split(torch.arange(groups), world)[accelerator.process_index]
    lo, hi = int(block[0]) * per_group, (int(block[-1]) + 1) * per_group
    mine = sample_sde_batched(policy, prompts[lo:hi], seeds[lo:hi], sc.batch_size, steps=sc.train_steps,
                              noise_level=sc.noise_level, guidance=sc.guidance, negative_prompt=sc.negative_prompt)
    shard = {"latents": mine.latents.cpu(), "log_probs": mine.log_probs.cpu(), "images": mine.images.cpu(),
             "components": reward.components(mine.images, prompts[lo:hi])}
    shards: list[Any] = [None] * world
    torch.distributed.all_gather_object(shards, shard)
    device = policy.device
    rollout = Rollout(list(prompts), [int(s) for s in seeds],
                      torch.cat([x["latents"] for x in shards]).to(device),
                      torch.cat([x["log_probs"] for x in shards]).to(device),
                      torch.cat([x["images"] for x in shards]).to(device))
    components = {name: torch.cat([x["components"][name] for x in shards]) for name in shard["components"]}
    return rollout, components, world


@committed_stage(iteration_key("update"))
def update(run: Run, t: int, key: str) -> Commit:
    """Rollouts with theta_t on the filtered seeds, rewards, group advantages, PPO-clip steps -> theta_{t+1}."""
    cfg, sc, gc = run.cfg, run.cfg.sampler, run.cfg.grpo
    started = time.perf_counter()
    chosen = filter_seeds(run, t).json("filtered.json")
    torch.manual_seed(derive_seed(cfg.run.seed, "update", t))  # LoRA dropout and the like: same on every resume
    policy = run.training_policy(t)
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=gc.lr, weight_decay=gc.weight_decay)
    if t > 0:
        load_optimizer_tensors(optimizer, run.store.load(run.key("update", t - 1)).tensors("optimizer.safetensors"))
    ema = None
    if gc.ema is not None:  # the average of theta_0..theta_t's steps so far (of theta_0: itself)
        ema = WeightsEMA(gc.ema, ema_state(run, t) or policy.trainable_state(),
                         steps_done=t * gc.epochs * gc.optimizer_steps)
    prompts = [p for p, seeds in zip(chosen["prompts"], chosen["seeds"]) for _ in seeds]
    seeds = [s for group in chosen["seeds"] for s in group]
    # Under `accelerate launch` / torchrun (sky/update.yaml, several GPUs or nodes; bench's data-parallel
    # baseline) each rank rolls out and scores its share of the prompt groups, the ranks exchange them,
    # and then every rank trains its share of each minibatch (DDP); in one process this changes nothing.
    accelerator = Accelerator(cpu=run.device.type == "cpu") if distributed() else None
    policy.eval()
    reward = run.weighted_reward("train")
    rollout, components, shards = sharded_rollouts(run, policy, reward, prompts, seeds, len(chosen["prompts"]),
                                                   accelerator)
    rewards = reward.combine(components)
    grouped = rewards.view(len(chosen["prompts"]), -1)
    advantages = recipe_advantages(grouped, gc).to(run.device)
    cond, uncond = encode_conditioning(policy, prompts, sc.guidance, sc.negative_prompt)
    batch = UpdateBatch(rollout, cond, uncond, advantages, policy.sigmas(sc.train_steps).to(run.device))
    if accelerator is not None:
        policy.transformer, optimizer = accelerator.prepare(policy.transformer, optimizer)
    policy.train()
    stats: list[dict[str, float]] = []
    for epoch in range(gc.epochs):
        stats += grpo_epoch(policy, params, optimizer, batch, optimizer_steps=gc.optimizer_steps,
                            clip_range=gc.clip_range, noise_level=sc.noise_level, guidance=sc.guidance,
                            max_grad_norm=gc.max_grad_norm, kl_beta=gc.kl_beta, kl_exact=gc.kl_form == "exact",
                            kl_reference=functools.partial(weights_swapped, policy, ema.average)
                            if gc.kl_reference == "ema" else None,
                            microbatch_size=gc.microbatch_size,
                            trained_steps=cfg.trained_steps,
                            generator=generator(cfg.run.seed, "minibatches", t, epoch),
                            rank=accelerator.process_index if accelerator else 0,
                            world=accelerator.num_processes if accelerator else 1,
                            after_step=functools.partial(ema.step, policy) if ema is not None else None)
    optimizer.zero_grad(set_to_none=True)  # past the last step the gradients are dead weight: free them
    policy.eval()
    if accelerator is not None:
        policy.transformer = accelerator.unwrap_model(policy.transformer)
        optimizer = optimizer.optimizer  # the plain AdamW inside accelerate's wrapper
        if not accelerator.is_main_process:  # one writer; the others wait for its commit
            accelerator.wait_for_everyone()
            return run.store.load(key)
    group_std = grouped.std(dim=1)
    metrics = {
        "iteration": t,
        "train_reward_mean": rewards.mean().item(),
        "train_reward_std": rewards.std().item(),
        "train_reward_components": {name: value.mean().item() for name, value in components.items()},
        "within_group_std": group_std.mean().item(),
        "zero_variance_groups": (group_std < 1e-3).float().mean().item(),
        "prompts_trained": len(chosen["prompts"]),
        "first_log_ratio": stats[0]["max_abs_log_ratio"],
        # the scale clip_range is compared with: |log ratio| over the rows (first minibatch: ~0, same weights)
        "mean_abs_log_ratio": sum(s["mean_abs_log_ratio"] for s in stats) / len(stats),
        "max_abs_log_ratio": max(s["max_abs_log_ratio"] for s in stats),
        "trained_steps": cfg.trained_steps,
        "clip_frac": sum(s["clip_frac"] for s in stats) / len(stats),
        "approx_kl": sum(s["approx_kl"] for s in stats) / len(stats),
        "optimizer_steps": len(stats),
        "rows_per_step": [s["minibatch_rows"] for s in stats],
        "data_parallel_processes": accelerator.num_processes if accelerator else 1,
        "rollout_shards": shards,  # processes that shared the rollouts
        "seconds": time.perf_counter() - started,
    }
    objects = {
        checkpoints.POLICY: tensors_to_bytes(policy.trainable_state()),
        checkpoints.OPTIMIZER: tensors_to_bytes(optimizer_tensors(optimizer)),
        "rewards.safetensors": tensors_to_bytes({"rewards": rewards, "advantages": advantages}),
        "metrics.json": json_bytes(metrics),
    }
    if ema is not None:
        objects[checkpoints.EMA] = tensors_to_bytes(ema.average)
    commit = run.store.commit(key, objects, {"iteration": t})
    checkpoints.prune(run.store, cfg.checkpoint, t, run.key)  # only now that theta_{t+1} is complete
    if accelerator is not None:
        accelerator.wait_for_everyone()
    run.progress("RL iterations", t + 1, gc.iterations)
    return commit


# -- evaluate ---------------------------------------------------------------------------------
GRID_PROMPTS, GRID_SEEDS, GRID_PIXELS = 10, 8, 128  # the sample grid each evaluation commits


def sample_grid(images: torch.Tensor, prompts: int) -> torch.Tensor:
    """Up to 10 prompts x 8 seeds of the evaluation images as uint8 tiles of at most 128 px: what the
    report shows, small enough to commit at every evaluation of a 1024 px model."""
    per_prompt = images.view(prompts, -1, *images.shape[1:])[:GRID_PROMPTS, :GRID_SEEDS]
    tiles = per_prompt.flatten(0, 1).float().cpu()
    if tiles.shape[-1] > GRID_PIXELS:
        tiles = torch.nn.functional.interpolate(tiles, size=(GRID_PIXELS, GRID_PIXELS), mode="area")
    pixels = ((tiles.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return pixels.view(*per_prompt.shape[:2], *pixels.shape[1:])


def evaluation_samples(run: Run, t: int, prompts: list[str], seeds: list[int]) -> torch.Tensor:
    """What evaluation scores: ODE samples of theta_t, its average when ``grpo.ema`` is on (as flow_grpo
    evaluates), at the config's evaluation steps and guidance."""
    sc = run.cfg.sampler
    with weights_swapped(run.policy_at(t), ema_state(run, t)) as policy:
        return sample_ode_batched(policy, prompts, seeds, sc.batch_size, steps=sc.eval_steps, guidance=sc.guidance,
                                  negative_prompt=sc.negative_prompt)


def evaluation_key(run: Run, t: int) -> str:
    return f"evaluations/{t:04d}"


@committed_stage(evaluation_key)
def evaluate(run: Run, t: int, key: str) -> Commit:
    """ODE samples of theta_t (its EMA when ``grpo.ema`` is on, as flow_grpo evaluates) on the fixed
    evaluation prompts and seeds, scored by the held-out and training rewards, and by what the rewards do
    not see (:mod:`spotlight.quality`): within-prompt diversity (also relative to theta_0's) and, for
    digits, realism."""
    base = evaluate(run, 0).json("metrics.json") if t > 0 else None  # the reference of diversity_vs_base
    prompts, seeds = evaluation_prompts(run.cfg)
    images = evaluation_samples(run, t, prompts, seeds)
    held_out = run.weighted_reward("eval")(images, prompts)
    train = run.weighted_reward("train")(images, prompts)
    n_prompts = len(prompts) // run.cfg.evaluation.seeds_per_prompt
    quality = quality_metrics(images, n_prompts, digit_images=run.cfg.model.kind == "tiny-mmdit")
    diversity_vs_base = (quality["diversity"] / base["diversity"] if base and base.get("diversity") else
                         1.0 if quality["diversity"] is not None else None)
    per_prompt = held_out.view(n_prompts, -1).mean(dim=1).tolist()
    by_tag = reward_by_tag(run.cfg, prompts[::run.cfg.evaluation.seeds_per_prompt], per_prompt)
    metrics = {"iteration": t, "weights": "ema" if run.cfg.grpo.ema is not None else "live",
               "eval_reward": held_out.mean().item(), "train_reward_on_eval": train.mean().item(),
               "eval_reward_per_prompt": per_prompt, **({"eval_reward_by_tag": by_tag} if by_tag else {}),
               "prompts": list(dict.fromkeys(prompts)), **quality, "diversity_vs_base": diversity_vs_base}
    return run.store.commit(key, {"metrics.json": json_bytes(metrics),
                                  "samples.safetensors": tensors_to_bytes({"grid": sample_grid(images, n_prompts)})},
                            {"iteration": t})


STAGES: dict[str, Callable[[Run, int], Commit]] = {
    "explore": explore, "filter": filter_seeds, "update": update, "evaluate": evaluate, "ranking": ranking_check,
}


def is_committed(run: Run, stage: str, t: int) -> bool:
    """Whether a stage's step of iteration t is in the store already (then there is nothing to post)."""
    if stage == "pretrain":
        digits = set(DIGIT_REWARDS) & set(run.cfg.rewards.names())
        classifiers = not digits or run.cache.is_committed(run.classifiers_key)
        return classifiers and (not run.pretrains_base or run.cache.is_committed(f"{run.base_key}/final"))
    if stage == "evaluate":
        return run.store.is_committed(evaluation_key(run, t))
    return run.store.is_committed(run.key(stage, t))


# -- per-iteration record -----------------------------------------------------------------------
def record_timing(run: Run, t: int, timing: dict[str, float]) -> None:
    """Wall-clock of iteration t as the orchestrator saw it (critical path, waits). Not a commit:
    timings are observations, rewritten if the iteration is re-run."""
    run.store.put_json(f"timeline/{t:04d}.json", {"iteration": t, **timing})


def iteration_metrics(run: Run, t: int) -> dict[str, Any]:
    """Everything known about iteration t: update metrics, filter and exploration stats, timings."""
    out = dict(run.store.load(run.key("update", t)).json("metrics.json"))
    filt = run.store.load(run.key("filter", t)).json("stats.json")
    if filt:
        out |= {"selected_std": filt["selected_std"], "random_std": filt["random_std"],
                "replaced_fraction": filt["replaced_fraction"], "low_variance_kept": filt["low_variance_kept"]}
    explored = run.store.load(run.key("explore", t))
    if "stats.json" in explored.manifest["objects"]:
        stats, decision = explored.json("stats.json"), explored.json("plan.json")
        out |= {"explored_candidates": stats["candidates"], "exploration_seconds": stats["wall_seconds"],
                "worker_utilisation": stats["worker_utilisation"],
                "planner_budget_candidates": decision["budget_candidates"],
                "planner_used_candidates": decision["used_candidates"]}
    if run.store.is_committed(run.key("ranking", t)):
        ranking = run.store.load(run.key("ranking", t)).json("metrics.json")
        out["ranking_spearman"] = ranking["spearman"]
        out["ranking_spearman_to_training"] = ranking["spearman_to_training"]
    if run.store.exists(f"timeline/{t:04d}.json"):
        out |= {f"timing_{k}": v for k, v in run.store.get_json(f"timeline/{t:04d}.json").items() if k != "iteration"}
    return out
