"""Run configuration: one YAML file says everything; unknown keys and bad values fail before compute."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Literal

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
    cpus: list[int] | None = Field(None, description="pin the trainer (flow process) to these CPUs")
    device: str = Field("auto", description="where policy and rewards compute: auto (cuda if present), cpu, "
                        "cuda or cuda:N; seeds draw on the CPU either way, so a seed means the same noise")

    @field_validator("device")
    @classmethod
    def _device(cls, name: str) -> str:
        kind, _, index = name.partition(":")
        if kind not in ("auto", "cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"unknown device {name!r}; devices: auto, cpu, cuda, cuda:N")
        return name


class ModelSection(Section):
    """A tiny SD3-style MMDiT (diffusers SD3Transformer2DModel) on 1x16x16 pixels."""

    sample_size: int = 16
    in_channels: int = 1
    patch_size: int = 4
    num_layers: int = 3
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    prompt_tokens: int = 4
    joint_attention_dim: int = 64
    pooled_projection_dim: int = 64


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
    shift: float = Field(3.0, gt=0, description="SD3 timestep shift")
    guidance: float = Field(1.0, ge=1.0, description="classifier-free guidance scale (1 = off)")


class RewardsSection(Section):
    train: str = "digit_classifier"
    eval: str = "heldout_classifier"
    runtime: str = Field("eager", description="reward-model runtime, or auto (fastest measured that passes parity)")

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, name: str) -> str:
        from spotlight.reward_runtime import RUNTIMES

        if name not in (*RUNTIMES, "auto"):
            raise ValueError(f"unknown reward runtime {name!r}; runtimes: auto, {', '.join(RUNTIMES)}")
        return name

    @field_validator("train", "eval")
    @classmethod
    def _known(cls, name: str) -> str:
        from spotlight.rewards import REWARDS

        if name not in REWARDS:
            raise ValueError(f"unknown reward {name!r}; known rewards: {', '.join(sorted(REWARDS))}")
        return name


class GRPOSection(Section):
    iterations: int = Field(20, ge=1)
    prompts_per_iteration: int = Field(8, ge=1)
    group_size: int = Field(8, description="G: rollouts per prompt in one update")
    lr: float = Field(1e-4, gt=0)
    clip_range: float = Field(0.2, gt=0)
    adv_clip: float = Field(5.0, gt=0)
    adv_std: Literal["per_prompt", "global"] = "per_prompt"
    kl_beta: float = Field(0.05, ge=0)
    minibatch_size: int = Field(64, ge=1, description="(sample, timestep) rows per optimizer step")
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
    candidates_per_prompt: int = Field(16, ge=1, description="floor per prompt is group_size; this is the first-iteration default")
    max_candidates_per_prompt: int = Field(64, ge=1)
    seeds_per_batch: int = Field(16, ge=1, description="a work unit: seeds rolled out together (fixed composition)")
    coarsen: int = Field(2, ge=1, description="an exploration rollout takes train_steps / coarsen SDE steps on the "
                         "training rollout's noise path (must divide sampler.train_steps; 1: full fidelity)")
    extra_prompts: int = Field(2, ge=0, description="explore this many more prompt groups than are trained; the "
                               "filter keeps the highest-variance ones, so low-variance prompts are replaced")
    min_std: float = Field(0.02, ge=0, description="a kept group below this std is reported as low-variance")
    budget_scale: float = Field(0.7, gt=0, description="exploration pool throughput relative to the trainer, in forward passes (measured: bench/time_to_target.py)")
    workers: int = Field(1, ge=0, description="local worker processes in the embedded default (0: explore in-process)")
    worker_cpus: list[int] | None = Field(None, description="pin local workers to these CPUs")
    lease_seconds: float = Field(30.0, gt=0)
    stall_seconds: float = Field(120.0, gt=0, description="no progress this long: the stage explores in-process")
    ranking_every: int = Field(5, ge=0, description="measure stale-vs-fresh seed ranking every N iterations (0: never)")
    ranking_prompts: int = Field(2, ge=1)


class EvaluationSection(Section):
    every: int = Field(5, ge=1, description="evaluate every N iterations (and at 0 and the end)")
    seeds_per_class: int = Field(16, ge=1)


class Config(Section):
    run: RunSection = RunSection()
    model: ModelSection = ModelSection()
    pretrain: PretrainSection = PretrainSection()
    sampler: SamplerSection = SamplerSection()
    rewards: RewardsSection = RewardsSection()
    grpo: GRPOSection = GRPOSection()
    exploration: ExplorationSection = ExplorationSection()
    evaluation: EvaluationSection = EvaluationSection()

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        if self.exploration.mode != "none" and self.exploration.candidates_per_prompt < self.grpo.group_size:
            raise ValueError(
                f"exploration.candidates_per_prompt ({self.exploration.candidates_per_prompt}) must be >= "
                f"grpo.group_size ({self.grpo.group_size})")
        if self.sampler.train_steps % self.exploration.coarsen:
            raise ValueError(f"exploration.coarsen ({self.exploration.coarsen}) must divide sampler.train_steps "
                             f"({self.sampler.train_steps}): a coarse exploration step sums whole training steps' "
                             "noise increments, so it ranks seeds like the training rollout")
        return self

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

    def fingerprint(self, *sections: str) -> str:
        """A short hash of the named sections (all if none): the cache key of what they determine."""
        data = self.model_dump(mode="json")
        picked = {s: data[s] for s in sections} if sections else data
        return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()[:16]


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
