"""Quality the reward does not see (spotlight.quality): diversity falls when samples collapse, and the
realism score prefers real digits to noisy ones."""

from __future__ import annotations

import torch

from spotlight.data import digits
from spotlight.quality import quality_metrics, realism_digits, realism_digits_real


def real_digit_grid(per_class: int = 6) -> torch.Tensor:
    images, labels = digits()
    return torch.cat([images[labels == d][:per_class] for d in range(10)])


def test_diversity_and_realism_see_collapse_and_noise():
    real = real_digit_grid()
    collapsed = real.view(10, 6, 1, 16, 16)[:, :1].expand(10, 6, 1, 16, 16).reshape(60, 1, 16, 16)
    noisy = (real + 0.3 * torch.randn(real.shape, generator=torch.Generator().manual_seed(0))).clamp(-1, 1)
    q_real, q_collapsed = quality_metrics(real, 10, True), quality_metrics(collapsed, 10, True)
    assert q_collapsed["diversity"] < 1e-6 < q_real["diversity"]
    assert len(q_real["diversity_per_prompt"]) == 10
    assert realism_digits(real) < realism_digits(noisy)
    assert 0 < realism_digits_real() < realism_digits(noisy)


def test_pipelines_get_diversity_and_an_explicit_skip_for_realism():
    rgb = torch.rand(4, 3, 128, 128) * 2 - 1  # 2 prompts x 2 seeds of a pipeline's images
    q = quality_metrics(rgb, 2, digit_images=False)
    assert q["diversity"] > 0 and q["realism_digits"] is None and "digit prompts only" in q["realism_skipped"]
    assert quality_metrics(rgb[:2], 2, digit_images=False)["diversity"] is None  # one seed per prompt
