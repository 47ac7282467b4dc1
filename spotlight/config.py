"""Run configuration: one YAML file says everything; unknown keys and bad values fail before compute."""

from __future__ import annotations

import csv
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config problem, named precisely (the key path and why)."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RunSection(Section):
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


class LoraSection(Section):
    """A LoRA adapter on the transformer (peft): the run store then holds only the adapter per iteration."""

    rank: int = Field(32, ge=1)
    alpha: float = Field(64.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(("to_q", "to_k", "to_v", "to_out.0"), min_length=1,
                                            description="module-name suffixes, as peft matches them")


class _ModelCommon(Section):
    lora: LoraSection | None = Field(None, description="train a LoRA adapter; null: full fine-tuning")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights' dtype: auto is bfloat16 on CUDA (autocast; log-probs and loss in fp32), else float32")
    gradient_checkpointing: bool = False


class TinyModelSection(_ModelCommon):
    """A tiny SD3-style MMDiT (diffusers SD3Transformer2DModel) on 1x16x16 pixels: the embedded default."""

    kind: Literal["tiny-mmdit"] = "tiny-mmdit"
    sample_size: int = 16
    in_channels: int = 1
    patch_size: int = 4
    num_layers: int = 3
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    prompt_tokens: int = 4
    joint_attention_dim: int = 64
    pooled_projection_dim: int = 64

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """What the policy decodes: pixel space, so the latent shape."""
        return (self.in_channels, self.sample_size, self.sample_size)


class PipelineModelSection(_ModelCommon):
    """A diffusers pipeline loaded with ``from_pretrained(pretrained)``: SD3/SD3.5, FLUX.1 or Qwen-Image."""

    kind: Literal["sd3", "flux", "qwen-image"]
    pretrained: str = Field(description="a diffusers pipeline folder: a local path or a mounted bucket")
    resolution: int = Field(512, ge=16, description="image height and width")
    max_sequence_length: int = Field(256, ge=1, description="text tokens (T5 / Qwen2.5-VL)")

    @field_validator("pretrained")
    @classmethod
    def _local(cls, path: str) -> str:
        if "://" in path:
            raise ValueError(f"{path!r} is a URL; give a local path (or a bucket mounted on this machine): "
                             "weights are never downloaded at run time")
        return path

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """What the pipeline's VAE decodes: RGB at the configured resolution."""
        return (3, self.resolution, self.resolution)


ModelSection = Annotated[TinyModelSection | PipelineModelSection, Field(discriminator="kind")]


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


class PickScoreSection(Section):
    model: str = Field(description="PickScore_v1 (a transformers CLIPModel folder)")
    processor: str | None = Field(None, description="its CLIP processor folder; default: the model folder")


class ClipScoreSection(Section):
    model: str = Field(description="a transformers CLIPModel folder (e.g. clip-vit-large-patch14)")


class AestheticSection(Section):
    clip_model: str = Field(description="the CLIP the head was trained on (ViT-L/14), a transformers folder")
    head: str = Field(description="LAION aesthetic predictor head weights (.pth or .safetensors)")


class RemoteRewardSection(Section):
    """A reward served over HTTP: POST images (and prompts), get one score per image."""

    url: str
    timeout_seconds: float = Field(60.0, gt=0)
    retries: int = Field(3, ge=0)
    batch_size: int = Field(32, ge=1, description="images per request")
    token_env: str | None = Field(None, description="environment variable holding a bearer token (never logged)")

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s) URL")
        return url


class RewardsSection(Section):
    """Rewards by name, as weighted sums (flow_grpo's ``reward_fn: {pickscore: 1.0, ...}``)."""

    train: dict[str, float] = Field({"digit_classifier": 1.0}, min_length=1,
                                    description="the reward RL maximises: name -> weight")
    eval: dict[str, float] = Field({"heldout_classifier": 1.0}, min_length=1,
                                   description="the held-out reward of evaluations: name -> weight")
    runtime: str = Field("eager", description="reward-model runtime, or auto (fastest measured that passes parity)")
    pickscore: PickScoreSection | None = None
    clip_score: ClipScoreSection | None = None
    aesthetic: AestheticSection | None = None
    remote: dict[str, RemoteRewardSection] = Field({}, description="HTTP rewards, each usable by its name")

    @field_validator("train", "eval", mode="before")
    @classmethod
    def _bare_name(cls, value: Any) -> Any:
        """A bare reward name means that reward with weight 1."""
        return {value: 1.0} if isinstance(value, str) else value

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, name: str) -> str:
        from spotlight.reward_runtime import RUNTIMES

        if name not in (*RUNTIMES, "auto"):
            raise ValueError(f"unknown reward runtime {name!r}; runtimes: auto, {', '.join(RUNTIMES)}")
        return name

    @model_validator(mode="after")
    def _known(self) -> "RewardsSection":
        from spotlight.rewards import REWARDS

        clash = sorted(set(self.remote) & set(REWARDS))
        if clash:
            raise ValueError(f"remote reward name(s) {clash} shadow built-in rewards; rename them")
        known = sorted({*REWARDS, *self.remote})
        for which in ("train", "eval"):
            for name in getattr(self, which):
                if name not in known:
                    raise ValueError(f"{which}: unknown reward {name!r}; known rewards: {', '.join(known)}")
                options = REWARDS[name].options if name in REWARDS else None
                if options and getattr(self, options) is None:
                    raise ValueError(f"{which}: reward {name!r} needs its weights: set rewards.{options} "
                                     "(local paths)")
        return self

    def describe(self, which: str) -> str:
        """``pickscore`` or ``1.0*pickscore + 0.5*aesthetic``: a reward as people read it."""
        weights = getattr(self, which)
        if len(weights) == 1 and next(iter(weights.values())) == 1.0:
            return next(iter(weights))
        return " + ".join(f"{w:g}*{name}" for name, w in weights.items())

    def names(self) -> list[str]:
        """Every reward a run scores with (train and eval), in a fixed order."""
        return sorted({*self.train, *self.eval})


class GRPOSection(Section):
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
    kl_beta: float = Field(0.05, ge=0)
    minibatch_size: int = Field(64, ge=1, description="(sample, timestep) rows per optimizer step")
    microbatch_size: int | None = Field(None, ge=1, description="rows per forward pass (gradient accumulation "
                                        "within a minibatch); null: the whole minibatch at once")
    epochs: int = Field(1, ge=1)
    max_grad_norm: float = Field(1.0, gt=0)

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
    candidates_per_prompt: int = Field(16, ge=1, description="floor per prompt is group_size; this is the first-iteration default")
    max_candidates_per_prompt: int = Field(64, ge=1)
    seeds_per_batch: int = Field(16, ge=1, description="a work unit: seeds rolled out together (fixed composition)")
    coarsen: int = Field(2, ge=1, description="an exploration rollout takes train_steps / coarsen SDE steps on the "
                         "training rollout's noise path (must divide sampler.train_steps; 1: full fidelity)")
    extra_prompts: int = Field(2, ge=0, description="explore this many more prompt groups than are trained; the "
                               "filter keeps the highest-variance ones, so low-variance prompts are replaced")
    min_std: float = Field(0.02, ge=0, description="a kept group below this std is reported as low-variance")
    budget_scale: float = Field(0.7, gt=0, description="exploration pool throughput relative to the trainer, in forward passes (measured: bench/time_to_target.py)")
    ranking_every: int = Field(5, ge=0, description="measure stale-vs-fresh seed ranking every N iterations (0: never)")
    ranking_prompts: int = Field(2, ge=1)


#: model kinds whose diffusers transformer has a ``_cp_plan`` (FluxTransformer2DModel, QwenImageTransformer2DModel)
SEQUENCE_PARALLEL_KINDS = ("flux", "qwen-image")


class SequenceParallelSection(Section):
    """One rollout of a high-resolution image shared by several GPUs (diffusers' context parallelism),
    as an elastic group of persistent processes (spotlight.sequence_parallel; docs/sequence_parallel.md)."""

    degree: int = Field(1, ge=1, description="processes (GPUs) of a group; the first generation forms when this "
                        "many are ready, later ones take the largest valid degree of the processes left")
    mode: Literal["ulysses", "ring"] = Field("ulysses", description="ulysses: all-to-all over heads (the degree "
                                             "must divide the heads); ring: K/V passed around (needs an attention "
                                             "backend that returns the log-sum-exp: CUDA only in diffusers 0.39)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend: auto is nccl "
                                                     "on CUDA, gloo on the CPU")
    attention_backend: str | None = Field(None, description="diffusers attention backend of the transformer; "
                                          "null: native for ulysses, _native_cudnn for ring")
    heartbeat_seconds: float = Field(0.5, gt=0, description="how often a process refreshes its record in the run store")
    dead_after_seconds: float = Field(5.0, gt=0, description="a record older than this: the process is gone")
    regroup_grace_seconds: float = Field(0.25, ge=0, description="after a failure, how long the new leader waits "
                                         "for the other survivors; a later one joins at a unit boundary")
    collective_timeout_seconds: float = Field(30.0, gt=0, description="a collective stuck this long (a hung peer) "
                                              "breaks the group, which then regroups")
    join_timeout_seconds: float = Field(60.0, gt=0, description="forming: wait this long for the first degree "
                                        "processes, and for a generation's members to connect")

    @model_validator(mode="after")
    def _heartbeats(self) -> "SequenceParallelSection":
        if self.dead_after_seconds <= 2 * self.heartbeat_seconds:
            raise ValueError(f"dead_after_seconds ({self.dead_after_seconds}) must exceed two heartbeats "
                             f"({2 * self.heartbeat_seconds}): one late write must not look like a death")
        return self


class DataSection(Section):
    """Where prompts come from (flow_grpo's layout: a folder with train.txt/test.txt or
    train_metadata.jsonl/test_metadata.jsonl; or one .txt/.jsonl file; or the bundled digit classes)."""

    prompts: str = Field("digits", description="digits | a .txt or .jsonl prompt file | a folder of train/test files")
    eval_prompts: str | None = Field(None, description="held-out prompts; default: the folder's test file "
                                     "(digits: the ten digit prompts)")


class EvaluationSection(Section):
    every: int = Field(5, ge=1, description="evaluate every N iterations (and at 0 and the end)")
    seeds_per_prompt: int = Field(16, ge=1, description="fixed evaluation seeds per held-out prompt")
    prompts: int | None = Field(None, ge=1, description="evaluate on the first N held-out prompts (null: all)")
    target: float | None = Field(None, description="held-out reward the report prices: cost and time until an "
                                 "evaluated policy first reaches it (a reading of results, not the recipe: a "
                                 "resumed run may change it)")


CATALOG_ACCELERATORS = Path(__file__).resolve().parent.parent / "sky" / "catalog" / "v8" / "common" / "accelerators.csv"


@functools.lru_cache(maxsize=1)
def catalog_accelerators() -> dict[str, str]:
    """SkyPilot's accelerator names (the shipped catalog snapshot), by lowercase name."""
    with open(CATALOG_ACCELERATORS, newline="") as f:
        return {row["AcceleratorName"].lower(): row["AcceleratorName"] for row in csv.DictReader(f)}


def parse_accelerator_spec(spec: str) -> tuple[str, int]:
    """``L4:1`` -> ("L4", 1), checked against SkyPilot's catalog; ValueError naming what is wrong."""
    name, sep, count = str(spec).partition(":")
    count = count if sep else "1"  # a bare name is one GPU, as in SkyPilot
    if not name or not count.isdigit() or int(count) < 1:
        raise ValueError(f"accelerator {spec!r}: expected NAME or NAME:COUNT, e.g. L4:1 or A100:8")
    known = catalog_accelerators()
    if name.lower() not in known:
        close = sorted(a for a in known.values() if a.lower().startswith(name.lower()[:2]))
        raise ValueError(f"accelerator {name!r} is not in SkyPilot's catalog (sky/catalog/v8/common/accelerators.csv)"
                         + (f"; did you mean one of {', '.join(close)}?" if close else ""))
    return known[name.lower()], int(count)


class WorkerKindSection(Section):
    """Where one kind of worker runs: how many, on which accelerators, spot or on-demand."""

    workers: int = Field(1, ge=0, description="long-lived workers of this kind (local processes or SkyPilot jobs)")
    accelerators: tuple[str, ...] = Field(min_length=1, description="SkyPilot any_of candidates, NAME:COUNT; the "
                                          "optimizer picks the cheapest offer on any enabled cloud")
    use_spot: bool = Field(True, description="spot (preemptible, recovered by SkyPilot) or on-demand")
    cpus: str | None = Field(None, description="SkyPilot cpus requirement, e.g. '8+' (null: the instance's)")
    memory: str | None = Field(None, description="SkyPilot memory requirement in GB, e.g. '32+'")
    disk_size: int = Field(100, ge=1, description="GB")
    local_cpus: list[int] | None = Field(None, description="embedded default: pin this kind's local worker "
                                         "processes to these CPUs")
    price_per_hour: float = Field(0.0, ge=0, description="what the cost ledger records per hour for a local "
                                  "worker of this kind (cloud workers: SkyPilot's record of the instance)")

    @field_validator("accelerators")
    @classmethod
    def _in_catalog(cls, specs: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f"{name}:{count}" for name, count in map(parse_accelerator_spec, specs))


DEFAULT_ACCELERATORS = {"trainer": ("A100:1", "A100-80GB:1", "H100:1", "L4:1", "A10G:1"),
                        "explorer": ("L4:1", "A10G:1", "A100:1", "H100:1")}


class PlacementSection(Section):
    """Where the run's work runs (not what it computes): may change between resumes of a run."""

    trainer: WorkerKindSection = WorkerKindSection(workers=1, accelerators=DEFAULT_ACCELERATORS["trainer"])
    explorer: WorkerKindSection = WorkerKindSection(workers=1, accelerators=DEFAULT_ACCELERATORS["explorer"])
    lease_seconds: float = Field(30.0, gt=0, description="a claimed work item's lease, renewed every third")
    stall_seconds: float = Field(120.0, gt=0, description="an exploration with no progress this long: the "
                                 "trainers join it (and the pool relaunches lost workers)")
    max_relaunches: int = Field(3, ge=0, description="per worker: relaunches after its job or process ended "
                                "while the run needed it, before the run fails naming it")
    idle_exit_seconds: float = Field(3600.0, gt=0, description="a cloud worker with no work this long exits "
                                     "(the controller is gone); the pool relaunches it when work comes")
    sequence_parallel: SequenceParallelSection = Field(
        default_factory=SequenceParallelSection, description="elastic sequence-parallel groups for "
        "high-resolution rollouts (spotlight.sequence_parallel); degree 1: none")

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """A kind given in part keeps its default accelerators."""
        if isinstance(data, dict):
            for kind, accelerators in DEFAULT_ACCELERATORS.items():
                if isinstance(data.get(kind), dict) and "accelerators" not in data[kind]:
                    data = {**data, kind: {**data[kind], "accelerators": accelerators}}
        return data

    @model_validator(mode="after")
    def _trainers(self) -> "PlacementSection":
        if self.trainer.workers < 1:
            raise ValueError(f"placement.trainer.workers is {self.trainer.workers}: a run needs at least one "
                             "trainer (it runs pretrain, update, evaluate and ranking)")
        return self


# Where these settings lived before placement had a section; committed configs of older runs (and
# older command lines) still use them, and are read as the placement they meant.
LEGACY_PLACEMENT = {("exploration", "workers"): ("explorer", "workers"),
                    ("exploration", "worker_cpus"): ("explorer", "local_cpus"),
                    ("exploration", "lease_seconds"): (None, "lease_seconds"),
                    ("exploration", "stall_seconds"): (None, "stall_seconds"),
                    ("run", "cpus"): ("trainer", "local_cpus")}


def _move_legacy_placement(data: dict[str, Any]) -> dict[str, Any]:
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    placement = dict(data.get("placement") or {})
    for (section, key), (kind, new) in LEGACY_PLACEMENT.items():
        if isinstance(data.get(section), dict) and key in data[section]:
            value = data[section].pop(key)
            target = placement if kind is None else placement.setdefault(kind, {})
            if kind is not None:
                target = placement[kind] = dict(target)
            if new in target and target[new] != value:
                raise ConfigError(f"{section}.{key} (the old spelling) and placement.{kind + '.' if kind else ''}{new} "
                                  "are both set, differently; keep placement's")
            target[new] = value
    if placement:
        data["placement"] = placement
    return data


class CheckpointSection(Section):
    """Which policies the run store keeps: the newest ``keep_last`` (with their optimizer state for the
    newest) and every ``keep_every``-th; older ones are pruned once a newer commit is complete."""

    keep_last: int | None = Field(None, ge=2, description="null: keep every policy; >= 2 since exploration "
                                  "reads theta_{t-1} while update(t) writes theta_{t+1}")
    keep_every: int | None = Field(None, ge=1, description="also keep theta_N for N a multiple of this")


class Config(Section):
    run: RunSection = RunSection()
    model: ModelSection = TinyModelSection()
    data: DataSection = DataSection()
    pretrain: PretrainSection = PretrainSection()
    sampler: SamplerSection = SamplerSection()
    # A factory, not an instance: validating a default at class definition would import spotlight.rewards
    # (the registry) while this module is half-loaded.
    rewards: RewardsSection = Field(default_factory=RewardsSection)
    grpo: GRPOSection = GRPOSection()
    exploration: ExplorationSection = ExplorationSection()
    evaluation: EvaluationSection = EvaluationSection()
    checkpoint: CheckpointSection = CheckpointSection()
    placement: PlacementSection = PlacementSection()

    @model_validator(mode="before")
    @classmethod
    def _default_kind(cls, data: Any) -> Any:
        """``model.kind`` may be left out: the tiny digits model. Placement's old spellings are moved."""
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "kind" not in data["model"]:
            data = {**data, "model": {**data["model"], "kind": "tiny-mmdit"}}
        if isinstance(data, dict):
            data = _move_legacy_placement(data)
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        digits = self.data.prompts == "digits"
        if self.model.kind == "tiny-mmdit" and not digits:
            raise ValueError(f"model.kind tiny-mmdit knows only the digit prompts; data.prompts is "
                             f"{self.data.prompts!r} (use a pipeline model.kind for text prompts)")
        digit_rewards = sorted({"digit_classifier", "heldout_classifier"} & set(self.rewards.names()))
        if digit_rewards and not digits:
            raise ValueError(f"rewards {digit_rewards} score digit classes: they need data.prompts: digits")
        if self.exploration.mode != "none" and self.exploration.candidates_per_prompt < self.grpo.group_size:
            raise ValueError(
                f"exploration.candidates_per_prompt ({self.exploration.candidates_per_prompt}) must be >= "
                f"grpo.group_size ({self.grpo.group_size})")
        sp = self.placement.sequence_parallel
        if sp.degree > 1 and self.model.kind not in SEQUENCE_PARALLEL_KINDS:
            raise ValueError(f"placement.sequence_parallel.degree is {sp.degree}, but model.kind {self.model.kind!r} "
                             "has no context-parallel plan in diffusers; sequence parallelism shards "
                             f"{' and '.join(SEQUENCE_PARALLEL_KINDS)} transformers")
        if self.sampler.train_steps % self.exploration.coarsen:
            raise ValueError(f"exploration.coarsen ({self.exploration.coarsen}) must divide sampler.train_steps "
                             f"({self.sampler.train_steps}): a coarse exploration step sums whole training steps' "
                             "noise increments, so it ranks seeds like the training rollout")
        return self

    @property
    def trained_steps(self) -> int:
        """SDE steps per rollout the update trains on: the first ``int(train_steps * timestep_fraction)``
        (flow_grpo's truncation), at least one."""
        return max(1, int(self.sampler.train_steps * self.sampler.timestep_fraction + 1e-9))

    @property
    def exploration_steps(self) -> int:
        return self.sampler.train_steps // self.exploration.coarsen

    @property
    def run_url(self) -> str:
        return self.run.url or f"file://{Path('runs').absolute() / self.run.name}"

    @property
    def cache_url(self) -> str:
        return self.run.cache_url or f"{self.run_url.rstrip('/').rsplit('/', 1)[0]}/_cache"

    def resolved(self) -> "Config":
        """The same config with the store URLs filled in (what a run commits and compares)."""
        run = self.run.model_copy(update={"url": self.run_url, "cache_url": self.cache_url})
        return self.model_copy(update={"run": run})

    def recipe(self) -> dict[str, Any]:
        """What a run computes, which a resumed run must keep: everything but placement (where it runs)
        and evaluation.target (how the report reads the results)."""
        data = self.model_dump(mode="json")
        data.pop("placement")
        data["evaluation"].pop("target")
        return data

    def with_placement(self, placement: "PlacementSection | dict[str, Any]") -> "Config":
        if isinstance(placement, dict):
            placement = PlacementSection.model_validate(placement)
        return self.model_copy(update={"placement": placement})

    def fingerprint(self, *sections: str) -> str:
        """A short hash of the named sections (all if none): the cache key of what they determine."""
        data = self.model_dump(mode="json")
        return fingerprint({s: data[s] for s in sections} if sections else data)


def fingerprint(data: Any) -> str:
    """A short, stable hash of JSON-able data."""
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["grpo.lr=3e-4", ...]`` -> nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), yaml.safe_load(raw))
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _explain(err: ValidationError, source: str) -> ConfigError:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = "unknown key (not a setting)" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {where}: {msg}")
    return ConfigError(f"invalid config {source}:\n" + "\n".join(lines))


def config_from_dict(data: dict[str, Any], source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise _explain(e, source) from None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None,
                run_url: str | None = None) -> Config:
    """Load a YAML config (or the defaults), apply ``section.key=value`` overrides, and point it at
    ``run_url`` if given (the CLI's ``--run``, the flow's ``run_url`` parameter)."""
    overrides = [*(overrides or []), *([f"run.url={run_url}"] if run_url else [])]
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        if not Path(path).is_file():
            raise ConfigError(f"config file {source} does not exist")
        data = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"invalid config {source}: top level must be a mapping of sections")
    data = _merge(data, parse_overrides(overrides))
    return config_from_dict(data, source + (f" with overrides {overrides}" if overrides else ""))
