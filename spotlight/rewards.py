"""Rewards, chosen by name in the config: ``reward(images, prompts) -> [B] float32``.

- ``digit_classifier``: probability of the prompted digit under the reward CNN (the training reward).
- ``heldout_classifier``: the same under an independently trained CNN (another architecture, the
  other half of the data), used only for evaluation, to catch reward hacking.
- ``jpeg_compressibility``: minus the JPEG size in kB, as in DDPO.

Model rewards score through :mod:`spotlight.reward_runtime`, so the runtime (eager, compiled,
ONNX Runtime...) is a config choice measured per device.
"""

from __future__ import annotations

import io
from typing import Callable, Protocol, Sequence

import numpy as np
import torch
from PIL import Image

from spotlight.data import prompt_class
from spotlight.models.classifier import DigitClassifier


class Reward(Protocol):
    name: str

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor: ...


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


# name -> which pretrained classifier it needs (None: no model)
REWARDS: dict[str, str | None] = {
    "digit_classifier": "reward_classifier",
    "heldout_classifier": "eval_classifier",
    "jpeg_compressibility": None,
}
