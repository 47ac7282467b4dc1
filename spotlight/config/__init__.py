"""Run configuration: one YAML file says everything; unknown keys and bad values fail before compute.

The sections live beside what they configure, in the order ``Config.recipe()`` draws the line:
:mod:`~spotlight.config.model` (the policy: what the memory planner reads), :mod:`~spotlight.config.recipe`
(sampler, GRPO, exploration, ...: what a run computes and a resume must keep), :mod:`~spotlight.config.rewards`
(the reward sections and names) and :mod:`~spotlight.config.placement` (where the work runs: may change
between resumes). This module puts them together in :class:`Config` and loads it from YAML and ``--set``
overrides; every name stays importable from here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator

from spotlight.config.base import ConfigError, Section, fingerprint
from spotlight.config.model import (LoraSection, ModelSection, PipelineModelSection, TinyModelSection)
from spotlight.config.placement import (DEFAULT_ACCELERATORS, LEGACY_PLACEMENT, SEQUENCE_PARALLEL_KINDS,
                                        PlacementSection, SequenceParallelSection, WorkerKindSection,
                                        move_legacy_placement)
from spotlight.config.recipe import (CheckpointSection, DataSection, EMASection, EvaluationSection,
                                     ExplorationSection, GRPOSection, PretrainSection, RunSection, SamplerSection)
from spotlight.config.rewards import (REWARDS, AestheticSection, ClipScoreSection, PickScoreSection,
                                      RemoteRewardSection, RewardEntry, RewardsSection)

__all__ = ["AestheticSection", "CheckpointSection", "ClipScoreSection", "Config", "ConfigError", "DataSection",
           "DEFAULT_ACCELERATORS", "EMASection", "EvaluationSection", "ExplorationSection", "GRPOSection",
           "LEGACY_PLACEMENT",
           "LoraSection", "ModelSection", "PickScoreSection", "PipelineModelSection", "PlacementSection",
           "PretrainSection", "REWARDS", "RemoteRewardSection", "RewardEntry", "RewardsSection", "RunSection",
           "SEQUENCE_PARALLEL_KINDS", "SamplerSection", "Section", "SequenceParallelSection", "TinyModelSection",
           "WorkerKindSection", "config_from_dict", "fingerprint", "load_config", "parse_overrides"]


class Config(Section):
    run: RunSection = RunSection()
    model: ModelSection = TinyModelSection()
    data: DataSection = DataSection()
    pretrain: PretrainSection = PretrainSection()
    sampler: SamplerSection = SamplerSection()
    rewards: RewardsSection = RewardsSection()
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
            data = move_legacy_placement(data)
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
        chosen = self.exploration.variance_seeds
        if chosen is not None and chosen > self.grpo.group_size:
            raise ValueError(f"exploration.variance_seeds ({chosen}) exceeds grpo.group_size ({self.grpo.group_size}): "
                             "it counts the seeds of one group chosen for variance")
        groups = self.exploration.variance_groups
        if groups is not None and groups > self.grpo.prompts_per_iteration:
            raise ValueError(f"exploration.variance_groups ({groups}) exceeds grpo.prompts_per_iteration "
                             f"({self.grpo.prompts_per_iteration}): it counts trained groups")
        sp = self.placement.sequence_parallel
        if sp.degree > 1 and self.model.kind not in SEQUENCE_PARALLEL_KINDS:
            raise ValueError(f"placement.sequence_parallel.degree is {sp.degree}, but model.kind {self.model.kind!r} "
                             "has no context-parallel plan in diffusers; sequence parallelism shards "
                             f"{' and '.join(SEQUENCE_PARALLEL_KINDS)} transformers")
        rows = self.grpo.prompts_per_iteration * self.grpo.group_size * self.trained_steps
        if self.grpo.optimizer_steps > rows:
            raise ValueError(f"grpo.optimizer_steps ({self.grpo.optimizer_steps}) exceeds the rows an iteration trains: "
                             f"{rows} (prompts_per_iteration {self.grpo.prompts_per_iteration} x group_size "
                             f"{self.grpo.group_size} x {self.trained_steps} trained steps)")
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


class _Whole(dict):
    """A mapping given whole in an override (``--set rewards.train='{bright: 1.0}'``): it replaces the mapping
    at that key instead of merging into it, so the file's ``{pickscore: 1.0}`` is gone, not kept beside it.
    A dotted key (``--set rewards.train.bright=1.0``) still sets one entry."""


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted!r}: {p!r} is not a section")
    node[leaf] = value


def parse_overrides(overrides: list[str]) -> dict[str, Any]:
    """``["grpo.lr=3e-4", ...]`` -> nested dict; values parsed as YAML (a mapping value replaces, see ``_Whole``)."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw)
        _set_dotted(tree, key.strip(), _Whole(value) if isinstance(value, dict) else value)
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, _Whole):
            out[k] = dict(v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
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
