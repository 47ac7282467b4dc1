"""The recipe sections: what a run computes (run identity, data, pretraining, sampler, GRPO, exploration,
evaluation, checkpoints). A resumed run must keep them (``Config.recipe``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spotlight.config.base import Section


class RunSection(Section):
    """Which run this is (its name and store), its seed, and where this process computes."""

    name: str = "tiny"
    url: str | None = Field(None, description="fsspec URL of the run store; default file://./runs/<name>")
    cache_url: str | None = Field(None, description="where pretrained bases are cached; default <runs root>/_cache")
    seed: int = 0
    threads: int = Field(1, ge=1, description="torch threads; fixed so results are bit-reproducible")
    device: str = Field("auto", description="where policy and rewards compute: auto (cuda if present), cpu, "
                        "cuda or cuda:N; seeds draw on the CPU either way, so a seed means the same noise")

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        kind, _, index = name.partition(":")
        if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"unknown device {name!r}; devices: auto, cpu, cuda, cuda:N")
        return name



class DataSection(Section):
    """Where prompts come from (flow_grpo's layout: a folder with train.txt/test.txt or
    train_metadata.jsonl/test_metadata.jsonl; or one .txt/.jsonl file; or the bundled digit classes)."""

    prompts: str = Field("digits", description="digits | a .txt or .jsonl prompt file | a folder of train/test files")
    eval_prompts: str | None = Field(None, description="held-out prompts; default: the folder's test file "
                                     "(digits: the ten digit prompts)")



class PretrainSection(Section):
    """Rectified-flow pretraining of the base policy, and the two reward classifiers."""

    steps: int = Field(200, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    ema_decay: float = Field(0.999, ge=0, lt=1)
    null_prompt_prob: float = Field(0.1, ge=0, le=1)
    commit_every: int = Field(500, ge=1)
    classifier_steps: int = Field(300, ge=1)


class SamplerSection(Section):
    """Flow-GRPO's SDE sampler of the training rollouts (and the ODE sampler of evaluations): steps, noise
    level, which steps the update trains, the timestep shift and guidance."""

    train_steps: int = Field(10, ge=1, description="SDE steps of a training rollout")
    eval_steps: int = Field(16, ge=1, description="ODE steps of an evaluation sample")
    noise_level: float = Field(0.7, gt=0, description="Flow-GRPO's a: sigma_t = a*sqrt(t/(1-t))")
    timestep_fraction: float = Field(0.99, gt=0, le=1, description="the update trains the first "
                                     "max(1, int(train_steps * fraction)) SDE steps of each rollout (flow_grpo's "
                                     "train.timestep_fraction: 0.99 of 10 steps trains 9, not the last)")
    shift: float | None = Field(None, gt=0, description="static timestep shift; null: the model's own (the "
                                "pipeline's scheduler config, 3.0 for tiny-mmdit)")
    guidance: float = Field(1.0, ge=1.0, description="guidance scale (1 = off): classifier-free guidance, or "
                            "the guidance embedding of guidance-distilled models (FLUX.1-dev)")
    negative_prompt: str = Field("", description="the unconditional prompt of classifier-free guidance")
    batch_size: int | None = Field(None, ge=1, description="rollouts (or evaluation samples) per forward pass; "
                                   "null: all of an update's at once")



class EMASection(Section):
    """flow_grpo's EMA of the trained weights (``flow_grpo/ema.py``, :mod:`spotlight.ema`): after the
    optimizer step that brings the run's count to n, when (n + 1) % every == 0, the average moves towards
    the weights by 1 - min((1 + n) / (10 + n), decay), a warm-up that lets the first updates count.
    flow_grpo's SD3 and FLUX recipes: decay 0.9 every 8 steps ("affects the previous 20 x 8 = 160 steps
    on average")."""

    decay: float = Field(0.9, ge=0, lt=1)
    every: int = Field(8, ge=1, description="update the average every N optimizer steps")


class GRPOSection(Section):
    """The policy update (Flow-GRPO): prompts and group size per iteration, group-relative advantages, the
    PPO-clipped loss with its KL term, and the optimizer's minibatches."""

    iterations: int = Field(20, ge=1)
    prompts_per_iteration: int = Field(8, ge=1)
    group_size: int = Field(8, description="G: rollouts per prompt in one update")
    lr: float = Field(2e-4, gt=0)
    clip_range: float = Field(0.01, gt=0, description="PPO clip on the ratio of per-step log-probs (each a mean over "
                              "latent dimensions, as flow_grpo's, so ratios stay near 1: on the tiny model "
                              "|log ratio| averages ~3e-3, and 0.01 clips 4-13% of the rows; docs/exploration.md)")
    adv_clip: float = Field(5.0, gt=0)
    adv_std: Literal["per_prompt", "global"] = Field(
        "per_prompt", description="advantages divided by each prompt group's reward std, or by the whole "
        "batch's (flow_grpo's SD3 configs: global); chosen by iterations to target, docs/exploration.md")
    adv_std_floor: float = Field(
        0.0, ge=0, description="the least reward std a group's advantages are divided by: a solved prompt's "
        "near-equal rewards then give small advantages instead of +-1 (0: Flow-GRPO; docs/recipe.md)")
    negative_advantage_weight: float = Field(
        1.0, ge=0, le=1, description="scales the advantages of a group's below-average samples: 1 is Flow-GRPO; "
        "0 reinforces only the better samples and pushes none away, which keeps within-prompt diversity "
        "(docs/recipe.md)")
    kl_beta: float = Field(0.24, ge=0, description="weight of the KL to the reference (kl_reference; flow_grpo's: "
                           "the base), as flow_grpo's train.beta: "
                           "per step |mean - mean_ref|^2 / (2 std_t^2), no dt (spotlight.grpo.step_kl)")
    kl_form: Literal["flow_grpo", "exact"] = Field(
        "flow_grpo", description="flow_grpo: its per-step term, no dt; exact: the KL between the two Gaussian "
        "steps (flow_grpo's / |dt|), whose sum over steps is the trajectory's KL to the base")
    kl_reference: Literal["base", "ema"] = Field(
        "base", description="what the KL is taken to: the base (theta_0, flow_grpo's), or the EMA of the trained "
        "weights (grpo.ema), a reference that moves with the run (docs/recipe.md)")
    optimizer_steps: int = Field(9, ge=1, description="optimizer steps per epoch over an iteration's trained "
                                 "(sample, timestep) rows, each on an equal share of them (flow_grpo: 2)")
    microbatch_size: int | None = Field(None, ge=1, description="rows per forward pass (gradient accumulation "
                                        "within a minibatch); null: the whole minibatch at once")
    epochs: int = Field(1, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)
    weight_decay: float = Field(1e-4, ge=0, description="AdamW's decoupled weight decay (flow_grpo: 1e-4)")
    ema: EMASection | None = Field(None, description="an exponential moving average of the trained weights, "
                                   "which evaluation and export use; null: none (the live weights)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "minibatch_size" in data:
            raise ValueError("grpo.minibatch_size is now grpo.optimizer_steps: optimizer steps per epoch, each on an "
                             "equal share of the iteration's prompts x group_size x trained steps rows (flow_grpo: 2)")
        return data

    @model_validator(mode="after")
    def _kl_to_the_ema(self) -> "GRPOSection":
        if self.kl_reference == "ema" and self.ema is None:
            raise ValueError("grpo.kl_reference: ema needs grpo.ema (the average the KL is taken to)")
        return self

    @field_validator("group_size")
    @classmethod
    def _group(cls, g: int) -> int:
        if g < 2:
            raise ValueError(f"group size must be >= 2 for group-relative advantages (got {g})")
        return g


class ExplorationSection(Section):
    """Seed exploration: none (random seeds), sync (fresh weights, on the critical path), spotlight (stale, overlapped)."""

    mode: Literal["none", "sync", "spotlight"] = "spotlight"
    select: Literal["both", "prompts", "seeds"] = Field(
        "both", description="what the filter selects (ablations): both = per prompt the max-variance G seeds, "
        "then the highest-variance groups among prompts_per_iteration + extra_prompts; prompts = the "
        "highest-variance groups, each trained on its first G seeds; seeds = no extra prompts, per prompt "
        "the max-variance G seeds")
    variance_seeds: int | None = Field(None, ge=0, description="of each trained group's G seeds, how many the "
                                       "filter chooses for reward variance; the rest are the prompt's first "
                                       "candidates, as drawn (typical samples beside the tails). null: all G")
    variance_groups: int | None = Field(None, ge=0, description="of the prompts_per_iteration trained groups, how "
                                        "many (those of most variance) train their chosen seeds; the others their "
                                        "first G candidates, as drawn. null: all")
    candidates_per_prompt: int = Field(16, ge=1, description="floor per prompt is group_size; this is the "
                                       "first-iteration default")
    max_candidates_per_prompt: int = Field(64, ge=1)
    seeds_per_batch: int = Field(16, ge=1, description="a work unit: seeds rolled out together (fixed composition)")
    coarsen: int = Field(2, ge=1, description="an exploration rollout takes train_steps / coarsen SDE steps on the "
                         "training rollout's noise path (must divide sampler.train_steps; 1: full fidelity)")
    extra_prompts: int = Field(2, ge=0, description="explore this many more prompt groups than are trained; the "
                               "filter keeps the highest-variance ones, so low-variance prompts are replaced")
    min_std: float = Field(0.02, ge=0, description="a kept group below this std is reported as low-variance")
    budget_scale: float = Field(0.7, gt=0, description="exploration pool throughput relative to the trainer, in "
                                "forward passes (measured: bench/time_to_target.py)")
    ranking_every: int = Field(5, ge=0, description="measure stale-vs-fresh seed ranking every N iterations (0: never)")
    ranking_prompts: int = Field(2, ge=1)




class EvaluationSection(Section):
    """Held-out evaluation: how often, on how many prompts and fixed seeds, and the reward the report prices."""

    every: int = Field(5, ge=1, description="evaluate every N iterations (and at 0 and the end)")
    seeds_per_prompt: int = Field(16, ge=1, description="fixed evaluation seeds per held-out prompt")
    prompts: int | None = Field(None, ge=1, description="evaluate on the first N held-out prompts (null: all)")
    target: float | None = Field(None, description="held-out reward the report prices: cost and time until an "
                                 "evaluated policy first reaches it (a reading of results, not the recipe: a "
                                 "resumed run may change it)")



class CheckpointSection(Section):
    """Which policies the run store keeps: the newest ``keep_last`` (with their optimizer state for the
    newest) and every ``keep_every``-th; older ones are pruned once a newer commit is complete."""

    keep_last: int | None = Field(None, ge=2, description="null: keep every policy; >= 2 since exploration "
                                  "reads theta_{t-1} while update(t) writes theta_{t+1}")
    keep_every: int | None = Field(None, ge=1, description="also keep theta_N for N a multiple of this")

