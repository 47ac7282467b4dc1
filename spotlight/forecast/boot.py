"""How long a worker takes from getting an instance to taking work: setup, then reading its weights.

``boot seconds = setup + weight bytes / bandwidth``, for the first launch and after every preemption
(a recovered worker is a new VM). Trainers and explorers load the same frozen weights: the pipeline
(transformer, text encoders, VAE) and the reward models (explorers score their rollouts); the
trainer's reference policy is the same base with its adapter off. The trainer's figure (it also loads
the evaluation rewards) is used for both.

Where the weight bytes come from:

1. the files on disk: ``model.pretrained`` and each reward's weights folder, when this machine has them
   (a user with the weights gets their exact size);
2. otherwise the memory plan's count (:func:`spotlight.memory_plan.worker_weight_bytes`): the published
   architecture built on the meta device, in the dtypes a GPU worker loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotlight.config import Config
from spotlight.forecast.errors import ForecastError

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt")


@dataclass(frozen=True)
class WeightBytes:
    bytes: int
    source: str


def _on_disk(folder: str | None) -> int | None:
    path = Path(folder) if folder else None
    if path is None or not path.exists():
        return None
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES]
    return sum(p.stat().st_size for p in files) or None


def weight_bytes(cfg: Config) -> WeightBytes:
    """Frozen weight bytes a trainer loads at boot, with where the figure comes from."""
    from spotlight.memory_plan import reward_weight_bytes, worker_weight_bytes

    found = _on_disk(getattr(cfg.model, "pretrained", None))
    if found is None:
        return WeightBytes(worker_weight_bytes(cfg, "trainer"), "the memory plan's trainer weights (the "
                           "architecture on meta, in the dtypes a GPU worker loads)")
    parts, sources = [found], [f"{cfg.model.pretrained} on disk"]
    for name in sorted({*cfg.rewards.train, *cfg.rewards.eval}):
        found = _on_disk(getattr(getattr(cfg.rewards, name, None), "model", None))
        counted = reward_weight_bytes(cfg, name) if found is None else None
        if found is not None:
            parts.append(found)
            sources.append(f"{name} weights on disk")
        elif counted is not None:
            parts.append(counted)
            sources.append(f"{name}: the memory plan's count")
    return WeightBytes(sum(parts), "; ".join(sources))


@dataclass(frozen=True)
class Boot:
    """What a worker pays each time it gets an instance."""

    setup_seconds: float  # provisioning and the task's setup (stated)
    bandwidth_gb_s: float  # reading the weights from the bucket or disk cache (stated)
    weights: WeightBytes

    def __post_init__(self) -> None:
        if self.setup_seconds < 0 or self.bandwidth_gb_s <= 0:
            raise ForecastError(f"boot: setup {self.setup_seconds} s must be >= 0 and bandwidth "
                                f"{self.bandwidth_gb_s} GB/s > 0")

    @property
    def seconds(self) -> float:
        return self.setup_seconds + self.weights.bytes / (self.bandwidth_gb_s * 1e9)

    def describe(self) -> str:
        return (f"boot {self.seconds:.0f} s per launch and per recovery = setup {self.setup_seconds:.0f} s + "
                f"{self.weights.bytes / 1e9:.1f} GB of weights at {self.bandwidth_gb_s:g} GB/s "
                f"({self.weights.source})")
