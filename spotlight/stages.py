"""The stages of a run as pure, idempotent functions: each computes its step once and commits it.

Calling a stage whose step is committed returns the commit without computing anything, so a
restarted flow (after kill -9, preemption or a Prefect retry) resumes from the last commit; all
randomness is derived from (run seed, stage, iteration), so the resumed run is bit-identical.

Iteration t uses policy theta_t (theta_0 = the pretrained base):
    explore(t) -> filter(t) -> update(t) commits theta_{t+1};  evaluate(t) scores theta_t.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from accelerate import Accelerator

from spotlight.config import Config, ConfigError, config_from_dict
from spotlight.data import DIGIT_PROMPTS, NUM_CLASSES
from spotlight.grpo import UpdateBatch, group_advantages, grpo_epoch
from spotlight.models.classifier import DigitClassifier
from spotlight.models.policy import TinyMMDiT, build_policy
from spotlight.pretrain import (BaseTrainer, classifier_accuracy, load_optimizer_tensors, optimizer_tensors,
                                train_classifier)
from spotlight.rewards import REWARDS, ClassifierReward, JpegCompressibility, Reward
from spotlight import exploration
from spotlight.filter import select
from spotlight.planner import PlannerState, plan, update_cost_forwards
from spotlight.sampler import sample_ode, sample_sde, sigma_schedule
from spotlight.seeding import derive_seed, generator
from spotlight.store import Commit, RunStore, json_bytes, tensors_to_bytes

Progress = Callable[[str, int, int], None]
CODE_VERSION = "1"  # bump when a cached stage's computation changes meaning


def _no_progress(desc: str, done: int, total: int) -> None:
    pass


@dataclass
class Run:
    """A run: its config, its store, and the cache of pretrained parts shared by runs."""

    cfg: Config
    store: RunStore
    cache: RunStore
    progress: Progress = _no_progress
    device: torch.device = torch.device("cpu")  # where this process computes (see `compute_device`)
    _rewards: dict[str, Reward] = field(default_factory=dict)
    _policies: dict[int, TinyMMDiT] = field(default_factory=dict)

    # -- keys ------------------------------------------------------------------------------
    @staticmethod
    def key(stage: str, t: int) -> str:
        return f"iterations/{t:04d}/{stage}"

    @property
    def base_key(self) -> str:
        return f"base-{self.cfg.fingerprint('model', 'pretrain')}-s{self.cfg.run.seed}-v{CODE_VERSION}"

    @property
    def classifiers_key(self) -> str:
        return f"classifiers-{self.cfg.fingerprint('pretrain')}-s{self.cfg.run.seed}-v{CODE_VERSION}"

    def eval_iterations(self) -> list[int]:
        n, every = self.cfg.grpo.iterations, self.cfg.evaluation.every
        return sorted({0, n, *range(every, n, every)})

    # -- models ----------------------------------------------------------------------------
    def policy_at(self, t: int) -> TinyMMDiT:
        """theta_t: the base for t = 0, else the policy committed by update(t - 1)."""
        policy = build_policy(self.cfg.model).to(self.device)
        if t == 0:
            state = self.cache.load(f"{self.base_key}/final").tensors("ema.safetensors")
        else:
            state = self.store.load(self.key("update", t - 1)).tensors("policy.safetensors")
        policy.load_trainable_state(state)
        return policy.eval()

    def cached_policy(self, t: int) -> TinyMMDiT:
        """theta_t for inference, kept in memory (exploration workers reuse it across items)."""
        if t not in self._policies:
            self._policies = {k: v for k, v in self._policies.items() if k >= t - 1}
            self._policies[t] = self.policy_at(t).requires_grad_(False)
        return self._policies[t]

    def reward(self, name: str) -> Reward:
        if name not in self._rewards:
            model_name = REWARDS[name]
            if model_name is None:
                self._rewards[name] = JpegCompressibility()
            else:
                self._rewards[name] = self._classifier_reward(name, model_name)
        return self._rewards[name]

    def _classifier_reward(self, name: str, model_name: str) -> ClassifierReward:
        from spotlight.reward_runtime import make_scorer

        commit = self.cache.load(self.classifiers_key)
        model = DigitClassifier(width=commit.meta[model_name]["width"])
        model.load_state_dict(commit.tensors(f"{model_name}.safetensors"))
        model.eval().requires_grad_(False)
        scorer = make_scorer(model, (1, 16, 16), runtime=self.cfg.rewards.runtime,
                             batch_size=self.cfg.grpo.prompts_per_iteration * self.cfg.grpo.group_size,
                             device=str(self.device),
                             cache_url=f"{self.cache.url}/reward-runtime", model_name=model_name)
        return ClassifierReward(name, model, scorer)


def distributed() -> bool:
    """Launched as one of several processes (accelerate launch / torchrun set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def compute_device(name: str) -> torch.device:
    """``run.device`` on this machine: auto is cuda when torch sees a GPU. Under a multi-GPU launch each
    process takes the GPU of its LOCAL_RANK. Asking for a GPU that is not there is an error, early."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device is {name!r} but torch {torch.__version__} sees no CUDA device "
                              f"(built for CUDA {torch.version.cuda}); use run.device=auto or cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if distributed() else 0)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"run.device is {name!r} (index {device.index}) but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def open_run(cfg: Config, progress: Progress = _no_progress) -> Run:
    """Open (or start) the run at cfg's URL. A run keeps the config it started with: another is an error.

    The store URL itself is not part of the comparison: a run may be opened from wherever its store is,
    and ``run.device: auto`` resolves per machine (same numbers for the same device type).
    """
    device = compute_device(cfg.run.device)
    torch.set_num_threads(cfg.run.threads)
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (must be set before its first call);
        # ops without a deterministic CUDA kernel warn (naming the op) instead of stopping a run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)
    cfg = cfg.resolved()
    store, cache = RunStore(cfg.run_url), RunStore(cfg.cache_url)
    if store.is_committed("config"):
        started = config_from_dict(store.load("config").json("config.json"), f"{store.url}/config")
        started = started.model_copy(update={"run": started.run.model_copy(update={"url": cfg.run_url})})
        if started != cfg:
            raise ConfigError(f"run {store.url} was started with another config; differences:\n"
                              + _config_diff(started.model_dump(), cfg.model_dump())
                              + "\nuse another run.name/run.url, or the original config")
    else:
        store.commit("config", {"config.json": json_bytes(cfg.model_dump(mode="json"))})
    return Run(cfg, store, cache, progress, device)


def open_run_from_url(url: str, progress: Progress = _no_progress) -> Run:
    """Open an existing run from its store URL alone (workers, stage jobs): its committed config says the rest."""
    store = RunStore(url)
    if not store.is_committed("config"):
        raise ConfigError(f"no run at {url}: it has no committed config (start it with `spotlight run`)")
    cfg = config_from_dict(store.load("config").json("config.json"), f"{url}/config")
    return open_run(cfg.model_copy(update={"run": cfg.run.model_copy(update={"url": url})}), progress)


def _config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    lines = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = _config_diff(va, vb, f"{prefix}{k}.")
            lines += [sub] if sub else []
        elif va != vb:
            lines.append(f"  {prefix}{k}: {va!r} (started) vs {vb!r} (now)")
    return "\n".join(lines)


# -- pretrain ----------------------------------------------------------------------------------
CLASSIFIERS = {"reward_classifier": ("a", 16, 1), "eval_classifier": ("b", 12, 2)}  # data half, width, seed


def pretrain(run: Run) -> Commit:
    """The cached base policy (EMA weights) and both reward classifiers; resumable in chunks."""
    cfg, cache = run.cfg, run.cache
    if not cache.is_committed(run.classifiers_key):
        objects, meta = {}, {}
        for name, (part, width, seed) in CLASSIFIERS.items():
            model = train_classifier(part, width, cfg.pretrain.classifier_steps, derive_seed(cfg.run.seed, name, seed),
                                     lambda d, n, _s, name=name: run.progress(f"train {name}", d, n))
            objects[f"{name}.safetensors"] = tensors_to_bytes(model.state_dict())
            held_out = "b" if part == "a" else "a"
            meta[name] = {"width": width, "trained_on": part, "accuracy_on_other_half": classifier_accuracy(model, held_out)}
        cache.commit(run.classifiers_key, objects, meta)
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
def prompts_for(cfg: Config, t: int) -> list[str]:
    """Iteration t's prompt groups: a seeded draw of digit classes (without replacement while they last).
    Exploring modes draw ``extra_prompts`` more, of which the filter keeps the most informative."""
    g = generator(cfg.run.seed, "prompts", t)
    n = cfg.grpo.prompts_per_iteration + (cfg.exploration.extra_prompts if cfg.exploration.mode != "none" else 0)
    order = torch.cat([torch.randperm(NUM_CLASSES, generator=g) for _ in range(-(-n // NUM_CLASSES))])
    return [DIGIT_PROMPTS[int(c)] for c in order[:n]]


def explore(run: Run, t: int, inline: bool | None = None) -> Commit:
    """Candidate seeds (and, when exploring, their rewards) for iteration t's prompts.

    Mode ``none``: G random seeds per prompt, nothing rolled out. Otherwise the planner sizes the
    exploration, the work goes through the run's queue, and the explored table is committed.
    ``inline``: this process explores too, alongside the workers (default: only if there are none).
    Who computed a unit never changes its result, so this changes timings, not numbers.
    """
    key = run.key("explore", t)
    if run.store.is_committed(key):
        return run.store.load(key)
    cfg, ec = run.cfg, run.cfg.exploration
    prompts = prompts_for(cfg, t)
    if ec.mode == "none":
        seeds = exploration.candidate_seeds(cfg, t, [cfg.grpo.group_size] * len(prompts))
        table = {"prompts": prompts, "seeds": seeds, "rewards": None}
        return run.store.commit(key, {"explored.json": json_bytes(table)}, {"mode": ec.mode})
    decision = plan_exploration(run, t, prompts)
    seeds = exploration.candidate_seeds(cfg, t, decision["counts"])
    items = exploration.make_items(prompts, seeds, ec.seeds_per_batch)
    inline = ec.workers == 0 if inline is None else inline
    queue = exploration.queue_for(run, t)  # one object: its caches of items and results serve gather too
    waited = exploration.explore_queue(run, t, queue, items, inline=inline)
    seeds, rewards, rollout_seconds = exploration.gather(queue, items)
    explorers = ec.workers + (1 if inline and ec.workers else 0) or 1
    stats = {**waited, "rollout_seconds": rollout_seconds, "candidates": sum(map(len, seeds)),
             "policy_iteration": exploration.policy_iteration(cfg, t), "explorers": explorers,
             "worker_utilisation": rollout_seconds / max(waited["wall_seconds"], 1e-9) / explorers}
    table = {"prompts": prompts, "seeds": seeds, "rewards": rewards}
    return run.store.commit(key, {"explored.json": json_bytes(table), "plan.json": json_bytes(decision),
                                  "stats.json": json_bytes(stats)}, {"mode": ec.mode})


def planner_state(run: Run, t: int) -> PlannerState:
    """The bandit's posteriors from every committed filter before t (the same set on every resume)."""
    state = PlannerState()
    for s in range(t):
        if run.store.is_committed(run.key("filter", s)):
            for row in run.store.load(run.key("filter", s)).json("stats.json").get("prompts", []):
                state.observe(row["prompt"], row["gain"])
    return state


def plan_exploration(run: Run, t: int, prompts: list[str]) -> dict[str, Any]:
    """How many candidates each prompt gets: Thompson sampling within the update step's cost."""
    cfg, ec, gc = run.cfg, run.cfg.exploration, run.cfg.grpo
    steps = cfg.exploration_steps
    update_forwards = update_cost_forwards(gc.prompts_per_iteration * gc.group_size, cfg.sampler.train_steps,
                                           gc.kl_beta > 0)
    budget = int(ec.budget_scale * update_forwards / steps)
    if t == 0:  # nothing learned yet: the configured default
        budget = max(budget, ec.candidates_per_prompt * len(prompts))
    state = planner_state(run, t)
    counts, sampled = plan(state, prompts, group_size=gc.group_size, batch=ec.seeds_per_batch,
                           budget_candidates=budget, max_per_prompt=ec.max_candidates_per_prompt,
                           generator=generator(cfg.run.seed, "planner", t))
    return {"counts": counts, "sampled_gain": sampled, "budget_candidates": budget,
            "used_candidates": sum(counts), "posteriors": state.to_json()}


def filter_seeds(run: Run, t: int) -> Commit:
    """The G seeds per prompt that go into update(t): the max-variance subset of the explored candidates."""
    key = run.key("filter", t)
    if run.store.is_committed(key):
        return run.store.load(key)
    explored = explore(run, t).json("explored.json")
    cfg, g = run.cfg, run.cfg.grpo.group_size
    if explored["rewards"] is None:
        chosen = {"prompts": explored["prompts"], "seeds": [s[:g] for s in explored["seeds"]]}
        return run.store.commit(key, {"filtered.json": json_bytes(chosen), "stats.json": json_bytes({})})
    rows, selections = [], []
    for prompt, seeds, rewards in zip(explored["prompts"], explored["seeds"], explored["rewards"]):
        sel = select(seeds, rewards, g)
        selections.append(sel)
        rows.append({"prompt": prompt, "candidates": len(seeds), "std": sel.std, "random_std": sel.random_std,
                     "gain": sel.std - sel.random_std, "kept": False})
    # keep the P groups with the most variance: low-variance prompts are replaced by extra ones
    best = sorted(sorted(range(len(rows)), key=lambda i: (-rows[i]["std"], i))[: cfg.grpo.prompts_per_iteration])
    for i in best:
        rows[i]["kept"] = True
    kept = {"prompts": [explored["prompts"][i] for i in best], "seeds": [selections[i].seeds for i in best]}
    kept_rows = [r for r in rows if r["kept"]]
    stats = {"prompts": rows, "selected_std": sum(r["std"] for r in kept_rows) / len(kept_rows),
             "random_std": sum(r["random_std"] for r in rows) / len(rows),
             "replaced_fraction": 1 - len(kept_rows) / len(rows),
             "low_variance_kept": sum(r["std"] < cfg.exploration.min_std for r in kept_rows)}
    return run.store.commit(key, {"filtered.json": json_bytes(kept), "stats.json": json_bytes(stats)})


def ranking_check(run: Run, t: int) -> Commit:
    """Do seed rankings survive one stale iteration? Re-roll iteration t's explored candidates of a few
    prompts with fresh theta_t and correlate (Spearman) with the rewards explored under theta_{t-1}:
    ``spearman`` at exploration fidelity (staleness alone), ``spearman_to_training`` against fresh
    full-step rollouts (staleness and coarsening together: what the update will see)."""
    key = run.key("ranking", t)
    if run.store.is_committed(key):
        return run.store.load(key)
    explored = explore(run, t)
    table, stale_at = explored.json("explored.json"), explored.json("stats.json")["policy_iteration"]
    items = exploration.make_items(table["prompts"], table["seeds"], run.cfg.exploration.seeds_per_batch)
    fresh = run.cached_policy(t)
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
def update(run: Run, t: int) -> Commit:
    """Rollouts with theta_t on the filtered seeds, rewards, group advantages, PPO-clip steps -> theta_{t+1}."""
    key = run.key("update", t)
    if run.store.is_committed(key):
        return run.store.load(key)
    cfg, sc, gc = run.cfg, run.cfg.sampler, run.cfg.grpo
    started = time.perf_counter()
    chosen = filter_seeds(run, t).json("filtered.json")
    policy = run.policy_at(t)
    params = list(policy.transformer.parameters())
    optimizer = torch.optim.AdamW(params, lr=gc.lr, weight_decay=0.0)
    if t > 0:
        load_optimizer_tensors(optimizer, run.store.load(run.key("update", t - 1)).tensors("optimizer.safetensors"))
    prompts = [p for p, seeds in zip(chosen["prompts"], chosen["seeds"]) for _ in seeds]
    seeds = [s for group in chosen["seeds"] for s in group]
    rollout = sample_sde(policy, prompts, seeds, sc.train_steps, sc.noise_level, sc.shift, sc.guidance)
    rewards = run.reward(cfg.rewards.train)(rollout.images, prompts)
    grouped = rewards.view(len(chosen["prompts"]), -1)
    advantages = group_advantages(grouped, gc.adv_std, gc.adv_clip).flatten().to(run.device)
    reference = run.policy_at(0) if gc.kl_beta > 0 else None
    batch = UpdateBatch(rollout, policy.encode_prompts(prompts),
                        policy.encode_prompts([""] * len(prompts)) if sc.guidance != 1.0 else None,
                        advantages, sigma_schedule(sc.train_steps, sc.shift).to(run.device))
    # Under `accelerate launch` (sky/update.yaml, several GPUs or nodes) the transformer is wrapped in
    # DDP and every rank trains on its share of each minibatch; in one process this changes nothing.
    accelerator = Accelerator(cpu=run.device.type == "cpu") if distributed() else None
    if accelerator is not None:
        policy.transformer, optimizer = accelerator.prepare(policy.transformer, optimizer)
    policy.train()
    stats: list[dict[str, float]] = []
    for epoch in range(gc.epochs):
        stats += grpo_epoch(policy, params, optimizer, batch, minibatch_size=gc.minibatch_size,
                            clip_range=gc.clip_range, noise_level=sc.noise_level, guidance=sc.guidance,
                            max_grad_norm=gc.max_grad_norm, kl_beta=gc.kl_beta, reference=reference,
                            generator=generator(cfg.run.seed, "minibatches", t, epoch),
                            rank=accelerator.process_index if accelerator else 0,
                            world=accelerator.num_processes if accelerator else 1)
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
        "within_group_std": group_std.mean().item(),
        "zero_variance_groups": (group_std < 1e-3).float().mean().item(),
        "prompts_trained": len(chosen["prompts"]),
        "first_log_ratio": stats[0]["max_abs_log_ratio"],
        "clip_frac": sum(s["clip_frac"] for s in stats) / len(stats),
        "approx_kl": sum(s["approx_kl"] for s in stats) / len(stats),
        "optimizer_steps": len(stats),
        "data_parallel_processes": accelerator.num_processes if accelerator else 1,
        "seconds": time.perf_counter() - started,
    }
    objects = {
        "policy.safetensors": tensors_to_bytes(policy.trainable_state()),
        "optimizer.safetensors": tensors_to_bytes(optimizer_tensors(optimizer)),
        "rewards.safetensors": tensors_to_bytes({"rewards": rewards, "advantages": advantages}),
        "metrics.json": json_bytes(metrics),
    }
    commit = run.store.commit(key, objects, {"iteration": t})
    if accelerator is not None:
        accelerator.wait_for_everyone()
    run.progress("RL iterations", t + 1, gc.iterations)
    return commit


# -- evaluate ---------------------------------------------------------------------------------
def eval_seeds(cfg: Config) -> tuple[list[str], list[int]]:
    """Fixed across iterations: the same prompts and seeds score every theta_t."""
    prompts, seeds = [], []
    for c in range(NUM_CLASSES):
        for j in range(cfg.evaluation.seeds_per_class):
            prompts.append(DIGIT_PROMPTS[c])
            seeds.append(derive_seed(cfg.run.seed, "eval", c, j))
    return prompts, seeds


def evaluate(run: Run, t: int) -> Commit:
    """ODE samples of theta_t on the fixed evaluation seeds, scored by the held-out and training rewards."""
    key = f"evaluations/{t:04d}"
    if run.store.is_committed(key):
        return run.store.load(key)
    sc = run.cfg.sampler
    policy = run.policy_at(t)
    prompts, seeds = eval_seeds(run.cfg)
    images = sample_ode(policy, prompts, seeds, sc.eval_steps, sc.shift, sc.guidance)
    held_out = run.reward(run.cfg.rewards.eval)(images, prompts)
    train = run.reward(run.cfg.rewards.train)(images, prompts)
    per_class = held_out.view(NUM_CLASSES, -1).mean(dim=1)
    metrics = {"iteration": t, "eval_reward": held_out.mean().item(), "train_reward_on_eval": train.mean().item(),
               "eval_reward_per_class": per_class.tolist()}
    grid = images.view(NUM_CLASSES, -1, *images.shape[1:])[:, :8]
    return run.store.commit(key, {"metrics.json": json_bytes(metrics),
                                  "samples.safetensors": tensors_to_bytes({"grid": grid})}, {"iteration": t})


STAGES: dict[str, Callable[[Run, int], Commit]] = {
    "explore": explore, "filter": filter_seeds, "update": update, "evaluate": evaluate, "ranking": ranking_check,
}


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
