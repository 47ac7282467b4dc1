"""The embedded data set: scikit-learn's bundled 8x8 digits, upscaled to 1x16x16 in [-1, 1]."""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import torch
import torch.nn.functional as F

NUM_CLASSES = 10
DIGIT_PROMPTS = tuple(f"a handwritten digit {d}" for d in range(NUM_CLASSES))
NULL_PROMPT = ""


def prompt_class(prompt: str) -> int:
    """The digit a class prompt asks for."""
    try:
        return DIGIT_PROMPTS.index(prompt)
    except ValueError:
        raise ValueError(f"not a digit prompt: {prompt!r}; expected one of {DIGIT_PROMPTS}") from None


@lru_cache(maxsize=1)
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1797 digits as ([N,1,16,16] float32 in [-1,1], [N] int64 labels)."""
    from sklearn.datasets import load_digits

    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(16, 16), mode="bilinear", align_corners=False)
    return (images * 2 - 1).clamp(-1, 1), torch.tensor(raw.target, dtype=torch.int64)


def other_half(part: Literal["a", "b"]) -> Literal["a", "b"]:
    """The half of the digits that ``part`` is not: what a classifier trained on ``part`` never saw."""
    return "b" if part == "a" else "a"


def split(part: Literal["a", "b"]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two disjoint halves, so the held-out evaluation classifier never sees the reward's data."""
    images, labels = digits()
    idx = torch.arange(len(labels))
    keep = idx % 2 == (0 if part == "a" else 1)
    return images[keep], labels[keep]
