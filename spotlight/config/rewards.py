"""The reward sections, and the registry of rewards as the config knows them.

The registry maps a reward name to where its factory lives (``"module:function"``), the section that
holds its weights' paths and its preflight check, as strings: they are resolved only when a reward is
built or checked (``spotlight.rewards``; torchtune's ``_component_`` and ``spotlight.models.policy.POLICIES``
work the same way). So the config validates reward names without importing any reward code, and the
reward modules import their sections from here, never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from spotlight.config.base import Section
from spotlight.reward_runtime import RUNTIMES


@dataclass(frozen=True)
class RewardEntry:
    """One registry entry: ``factory(ctx: RewardContext, name) -> Reward`` and ``check(section)`` as
    ``"module:function"`` paths; ``options`` names the ``rewards.<section>`` with the weights' paths
    (required when the reward is used)."""

    factory: str
    options: str | None = None
    check: str | None = None


REWARDS: dict[str, RewardEntry] = {
    "digit_classifier": RewardEntry("spotlight.rewards:reward_classifier"),
    "heldout_classifier": RewardEntry("spotlight.rewards:eval_classifier"),
    "jpeg_compressibility": RewardEntry("spotlight.rewards:jpeg_compressibility"),
    "pickscore": RewardEntry("spotlight.clip_rewards:build_pickscore", "pickscore", "spotlight.clip_rewards:check_pickscore"),
    "clip_score": RewardEntry("spotlight.clip_rewards:build_clip_score", "clip_score",
                              "spotlight.clip_rewards:check_clip_score"),
    "aesthetic": RewardEntry("spotlight.clip_rewards:build_aesthetic", "aesthetic",
                             "spotlight.clip_rewards:check_aesthetic"),
}


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
        if name not in (*RUNTIMES, "auto"):
            raise ValueError(f"unknown reward runtime {name!r}; runtimes: auto, {', '.join(RUNTIMES)}")
        return name

    @model_validator(mode="after")
    def _known(self) -> "RewardsSection":
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

