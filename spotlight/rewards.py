"""Rewards, chosen by name in the config: ``reward(images, prompts) -> [B] float32``.

One registry entry per reward (:data:`spotlight.config.rewards.REWARDS`: name -> factory, and the config
section holding its weights); the config combines them as weighted sums (``rewards.train: {pickscore: 1.0, ...}``).
Images are ``[B, C, H, W]`` in [-1, 1], as policies decode them.

- ``digit_classifier``: probability of the prompted digit under the reward CNN (the digits' training reward).
- ``heldout_classifier``: the same under an independently trained CNN (another architecture, the
  other half of the data), used only for evaluation, to catch reward hacking.
- ``jpeg_compressibility``: minus the JPEG size in kB, as in DDPO.
- ``pickscore``, ``clip_score``, ``aesthetic``: CLIP-based learned rewards from local weights
  (:mod:`spotlight.clip_rewards`).
- HTTP rewards named in ``rewards.remote`` (:mod:`spotlight.remote_reward`).

:func:`check_rewards` checks, before any compute, that every reward a run uses can be built (its
weights' paths exist, its token is set), naming what is missing.

Model rewards score through :mod:`spotlight.reward_runtime`, so the runtime (eager, compiled,
ONNX Runtime...) is a config choice measured per device.
"""

from __future__ import annotations

import importlib
import io
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import numpy as np
import torch
from PIL import Image

from spotlight.config import Config
from spotlight.config.base import ConfigError
from spotlight.config.rewards import REWARDS
from spotlight.data import prompt_class
from spotlight.models.classifier import DigitClassifier
from spotlight.store import RunStore


class Reward(Protocol):
    name: str

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


@dataclass
class RewardContext:
    """What a reward factory may use: the run's config and device, and the cache of pretrained parts."""

    cfg: Config
    device: torch.device
    cache: RunStore
    classifiers_key: str  # the cache commit holding the digit classifiers
    # [C, H, W] of the policy's decoded images: model rewards are built (exported, compiled) for this shape.
    image_shape: tuple[int, int, int]

    @property
    def batch_size(self) -> int:
        """The batch a reward sees in an update: the runtime is measured and compiled for it."""
        return self.cfg.grpo.prompts_per_iteration * self.cfg.grpo.group_size

    def scorer(self, model: torch.nn.Module, item_shape: tuple[int, ...], model_name: str):
        """``model`` on the configured runtime (measured and cached when ``auto``)."""
        from spotlight.reward_runtime import make_scorer

        return make_scorer(model, item_shape, runtime=self.cfg.rewards.runtime, batch_size=self.batch_size,
                           device=str(self.device), cache_url=f"{self.cache.url}/reward-runtime",
                           model_name=model_name)


class ClassifierReward:
    """Probability of the prompted class under a classifier, scored on the configured runtime."""

    def __init__(self, name: str, model: DigitClassifier, scorer: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.model, self.scorer = name, model, scorer

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        probs = self.scorer(images.float())
        target = torch.tensor([prompt_class(p) for p in prompts])
        return probs[torch.arange(len(prompts)), target].float()


class JpegCompressibility:
    """DDPO's compressibility reward: smaller JPEG (quality 95) is better; in -kB."""

    name = "jpeg_compressibility"

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        pixels = ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
        sizes = []
        for img in pixels:
            buf = io.BytesIO()
            Image.fromarray(np.squeeze(img, 0) if img.shape[0] == 1 else img.transpose(1, 2, 0)).save(
                buf, format="JPEG", quality=95)
            sizes.append(-len(buf.getvalue()) / 1000.0)
        return torch.tensor(sizes, dtype=torch.float32)


class WeightedReward:
    """A weighted sum of rewards; ``components`` keeps each term for the metrics."""

    def __init__(self, name: str, terms: dict[str, tuple[float, Reward]]):
        self.name, self.terms = name, terms

    def components(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, torch.Tensor]:
        return {name: reward(images, prompts).float().cpu() for name, (_, reward) in self.terms.items()}

    def combine(self, components: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum(weight * components[name] for name, (weight, _) in self.terms.items())

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.combine(self.components(images, prompts))


def _digit_classifier(which: str) -> Callable[[RewardContext, str], Reward]:
    def build(ctx: RewardContext, name: str) -> Reward:
        commit = ctx.cache.load(ctx.classifiers_key)
        model = DigitClassifier(width=commit.meta[which]["width"])
        model.load_state_dict(commit.tensors(f"{which}.safetensors"))
        model.eval().requires_grad_(False)
        return ClassifierReward(name, model, ctx.scorer(model, (1, 16, 16), which))
    return build


reward_classifier = _digit_classifier("reward_classifier")
eval_classifier = _digit_classifier("eval_classifier")


def jpeg_compressibility(ctx: RewardContext, name: str) -> Reward:
    return JpegCompressibility()


def resolve(path: str) -> Callable[..., Any]:
    """A registry entry's ``"module:function"``, imported now (the config names rewards without importing them)."""
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_rewards(cfg: Config) -> None:
    """Fail before any compute if a reward the run uses cannot be built: every problem, each named."""
    from spotlight.remote_reward import check_remote

    problems = []
    for name in cfg.rewards.names():
        entry = REWARDS.get(name)
        try:
            if name in cfg.rewards.remote:
                check_remote(name, cfg.rewards.remote[name])
            elif entry is not None and entry.check is not None:
                resolve(entry.check)(getattr(cfg.rewards, entry.options))
        except ConfigError as e:
            problems.append(f"  reward {name!r}: {e}")
    if problems:
        raise ConfigError("rewards cannot be built:\n" + "\n".join(problems))


def build_reward(ctx: RewardContext, name: str) -> Reward:
    """One named reward (a registry entry, or an HTTP reward of ``rewards.remote``)."""
    if name in ctx.cfg.rewards.remote:
        from spotlight.prompts import prompt_metadata
        from spotlight.remote_reward import RemoteReward

        return RemoteReward(name, ctx.cfg.rewards.remote[name], metadata=prompt_metadata(ctx.cfg))
    return resolve(REWARDS[name].factory)(ctx, name)
