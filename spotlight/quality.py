"""Quality the reward does not see: within-prompt diversity, and the realism of generated digits.

RL on a reward can buy reward with quality the reward is blind to: samples of one prompt that all
look alike (mode collapse), or strokes no real digit has. Evaluation records two scores that share
nothing with the rewards, next to the held-out reward:

- ``diversity``: per prompt, the mean pairwise RMS pixel distance between its evaluation samples
  (fixed seeds, ODE), averaged over prompts; images in [-1, 1], area-downsampled to at most 64 px so
  it costs the same for a 1024 px pipeline as for the 16 px digits. Works for any images; reported
  relative to the base policy's (``diversity_vs_base``: 1.0 = as diverse as theta_0).
- ``realism_digits`` (digit prompts only): the mean RMS pixel distance from each sample to its
  ``REALISM_K`` nearest real digits (scikit-learn's 1,797 digits). It has no learned weights at
  all, so it can share none with the reward classifiers and the policy cannot learn to please it
  through them; on 16x16 images, nearest-neighbour distance in pixel space is meaningful, and it
  penalises exactly what the classifiers forgive: noise, broken or extra strokes, smudges. Lower is
  better; ``realism_digits_real`` is the same statistic for the real digits themselves (each against
  the others), the value a perfect generator would approach. A policy that copies training digits
  would score well here, which is what the diversity score is for. Pipelines have no reference
  set, so for them the score is skipped, and the metrics say so.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F

DIVERSITY_PIXELS = 64
REALISM_K = 5


def _flat(images: torch.Tensor, pixels: int = DIVERSITY_PIXELS) -> torch.Tensor:
    x = images.detach().float().cpu().clamp(-1, 1)
    if x.shape[-1] > pixels:
        x = F.interpolate(x, size=(pixels, pixels), mode="area")
    return x.flatten(1).double()


def rms_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, d] x [m, d] -> [n, m] root-mean-square distances (per pixel), in float64."""
    sq = (a * a).sum(1, keepdim=True) + (b * b).sum(1) - 2 * a @ b.T
    return (sq.clamp_min(0) / a.shape[1]).sqrt()


def diversity_per_prompt(images: torch.Tensor, prompts: int) -> list[float]:
    """Mean pairwise RMS pixel distance among each prompt's samples (prompt-major order)."""
    flat = _flat(images)
    x = flat.view(prompts, -1, flat.shape[1])
    n = x.shape[1]
    if n < 2:
        raise ValueError("diversity needs at least two samples per prompt")
    out = []
    for group in x:
        d = rms_distances(group, group)
        out.append((d.sum() / (n * (n - 1))).item())  # the diagonal is 0
    return out


@lru_cache(maxsize=1)
def _real_digits() -> torch.Tensor:
    from spotlight.data import digits

    return _flat(digits()[0])


def realism_digits(images: torch.Tensor, k: int = REALISM_K) -> float:
    """Mean RMS pixel distance from each 1x16x16 sample to its k nearest real digits (lower: more realistic)."""
    real = _real_digits()
    x = _flat(images)
    if x.shape[1] != real.shape[1]:
        raise ValueError(f"realism_digits scores 1x16x16 digit images, got shape {tuple(images.shape[1:])}")
    return rms_distances(x, real).topk(k, dim=1, largest=False).values.mean().item()


@lru_cache(maxsize=1)
def realism_digits_real(k: int = REALISM_K) -> float:
    """The same statistic for the real digits, each against the other real digits (leave-one-out)."""
    real = _real_digits()
    d = rms_distances(real, real)
    d.fill_diagonal_(float("inf"))
    return d.topk(k, dim=1, largest=False).values.mean().item()


def quality_metrics(images: torch.Tensor, prompts: int, digit_images: bool) -> dict:
    """What evaluation records beside the reward (see the module docstring)."""
    if len(images) // prompts >= 2:
        per_prompt = diversity_per_prompt(images, prompts)
        out: dict = {"diversity": sum(per_prompt) / len(per_prompt), "diversity_per_prompt": per_prompt}
    else:
        out = {"diversity": None, "diversity_skipped": "one evaluation seed per prompt: nothing to compare"}
    if digit_images:
        out |= {"realism_digits": realism_digits(images), "realism_digits_real": realism_digits_real()}
    else:
        out |= {"realism_digits": None,
                "realism_skipped": "no real reference images for this prompt set (digit prompts only)"}
    return out
