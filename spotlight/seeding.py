"""Seeds: the integer that owns one rollout's whole noise stream, and every derived RNG of a run.

A rollout seed fixes a ``torch.Generator`` that draws the initial latent *and* every SDE step's
noise, so a (prompt, seed) rollout is reproducible bit for bit. Fixing only the initial latent is
not enough: seed rankings then do not survive even with identical weights.
"""

from __future__ import annotations

import hashlib

import torch

SEED_SPACE = 2**31 - 1


def derive_seed(*parts: object) -> int:
    """A stable integer from any parts (run seed, stage name, iteration...): same parts, same seed."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") % SEED_SPACE


def generator(*parts: object) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(*parts))


def rollout_generators(seeds: list[int]) -> list[torch.Generator]:
    """One generator per rollout; each draws that rollout's latent and all its step noise."""
    return [torch.Generator().manual_seed(int(s)) for s in seeds]


def draw(gens: list[torch.Generator], shape: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """One standard-normal draw of ``shape`` per generator, stacked: [len(gens), *shape], moved to ``device``.

    The generators are CPU generators on every device: a CUDA generator would draw other numbers, so
    the same seed would mean another rollout on a GPU worker than on the CPU trainer.
    """
    return torch.stack([torch.randn(shape, generator=g) for g in gens]).to(device)
