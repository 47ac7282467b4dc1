"""How long a worker takes from getting an instance to taking work: setup, then reading its weights.

``boot seconds = setup + weight bytes / bandwidth``, for the first launch and after every preemption
(a recovered worker is a new VM). Trainers and explorers load the same frozen weights: the pipeline
(transformer, text encoders, VAE) and the reward models (explorers score their rollouts); the
trainer's reference policy is the same base with its adapter off.

Where the weight bytes come from, first that applies:

1. the files on disk: ``model.pretrained`` and each reward's weights folder, when this machine has them
   (a user with the weights gets their exact size);
2. ``PLACEHOLDER_PARAMETERS``: the published parameter counts of the architectures the shipped configs
   name, at 2 bytes each (bf16).

SEAM: the memory plan (issue 17 item 3, ``spotlight plan``) computes frozen weight bytes per worker kind
from the real architectures on the meta device. When it lands, :func:`weight_bytes` should return its
figure (and drop the placeholder table); nothing else here changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotlight.config import Config
from spotlight.forecast.errors import ForecastError

BF16 = 2
#: published parameter counts (model cards / diffusers configs), by ``model.kind`` and by reward name.
#: Placeholder until the memory plan's meta-device count replaces it (see the module docstring).
PLACEHOLDER_PARAMETERS = {
    "sd3": ("SD3.5-Medium: MMDiT-X 2.5B + T5-XXL encoder 4.76B + CLIP-G 694.7M + CLIP-L 123.7M + VAE 83.7M",
            2.5e9 + 4.76e9 + 694.7e6 + 123.7e6 + 83.7e6),
    "flux": ("FLUX.1-dev: transformer 11.9B + T5-XXL encoder 4.76B + CLIP-L 123.1M + VAE 83.8M",
             11.9e9 + 4.76e9 + 123.1e6 + 83.8e6),
    "qwen-image": ("Qwen-Image: transformer 20.43B + Qwen2.5-VL-7B 8.29B + VAE 126.9M", 20.43e9 + 8.29e9 + 126.9e6),
    "tiny-mmdit": ("the digits model (built at start, < 1 MB)", 0.0),
    "pickscore": ("PickScore_v1 (CLIP ViT-H/14) 986M", 986e6),
}
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
    """Frozen weight bytes a trainer or explorer loads at boot, with where the figure comes from."""
    parts, sources = [], []
    found = _on_disk(getattr(cfg.model, "pretrained", None))
    if found is not None:
        parts.append(found)
        sources.append(f"{cfg.model.pretrained} on disk")
    elif cfg.model.kind in PLACEHOLDER_PARAMETERS:
        what, params = PLACEHOLDER_PARAMETERS[cfg.model.kind]
        parts.append(int(params * BF16))
        sources.append(f"placeholder: {what}, bf16")
    else:
        raise ForecastError(f"model.kind {cfg.model.kind!r}: no weights on disk and no published size to boot "
                            f"from (known: {', '.join(PLACEHOLDER_PARAMETERS)})")
    for name in sorted({*cfg.rewards.train, *cfg.rewards.eval}):
        section = getattr(cfg.rewards, name, None)
        found = _on_disk(getattr(section, "model", None))
        if found is not None:
            parts.append(found)
            sources.append(f"{name} weights on disk")
        elif name in PLACEHOLDER_PARAMETERS:
            what, params = PLACEHOLDER_PARAMETERS[name]
            parts.append(int(params * BF16))
            sources.append(f"placeholder: {what}, bf16")
        else:
            sources.append(f"{name}: no weights counted (built in, or served over HTTP)")
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
