"""The CLIP family of learned rewards: PickScore, CLIP score and the LAION aesthetic predictor.

Each reward's image side (the CLIP processor's preprocessing, the vision tower, the projection, the
L2 norm and, for the aesthetic predictor, its head) is one torch module scored through
:mod:`spotlight.reward_runtime`, so ``rewards.runtime`` (eager, compile, ONNX Runtime, auto...) applies
to the whole of it. It takes the policy's images as they are: [B, C, H, W] in [-1, 1] at the size the
run fixes (C = 1 is repeated to RGB, as the processor's ``convert_to_rgb`` does).

The preprocessing reproduces the processor's PIL path in torch: the image is quantised to 8 bits
(the image a user would save, and what flow_grpo hands its scorers), resized with PIL's own filter
weights (:func:`pil_resize_weights`, horizontal pass then vertical, each clamped to [0, 255] as PIL
does), center-cropped as transformers crops, rescaled and normalised. The resize is two matmuls with
fixed weight matrices, so it exports to ONNX and compiles like any layer. What remains different from
PIL is its 8-bit rounding after each pass: within 1.03/255 of a pixel as measured for the sizes policies
generate (square 512-1328 -> 224, 2:3, small test sizes), even on white noise. For some unusual aspect
ratios (e.g. 100x37 -> 86x32) Pillow 13 runs the vertical pass first, and pixels where the first pass
overshoots [0, 255] then differ by up to 17/255 on white noise (2/255 on smooth images).
``tests/test_rewards.py`` measures what the rounding costs in pixels and in scores.

Text embeddings are computed eagerly, one prompt at a time, and cached: prompts repeat across
iterations, and batch-1 embeddings have the same bits whichever batch a prompt first came in, so a
resumed run scores exactly as an uninterrupted one.

Score definitions:

- ``pickscore``: ``exp(logit_scale) * cos(image, text) / 26``, as flow_grpo's ``PickScoreScorer``
  (``flow_grpo/pickscore_scorer.py``: CLIPModel logits divided by 26 "to put it near [0, 1]").
- ``clip_score``: CLIPScore of Hessel et al. 2021 (arXiv 2104.08718, eq. 1): ``2.5 * max(cos, 0)``.
  torchmetrics' ``CLIPScore`` reports the same quantity scaled by 100 instead of 2.5.
- ``aesthetic``: the LAION aesthetic predictor v2 (christophschuhmann/improved-aesthetic-predictor):
  an MLP on L2-normalised CLIP ViT-L/14 image embeddings, about 1-10.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from spotlight.config.base import ConfigError
from spotlight.config.rewards import AestheticSection, ClipScoreSection, PickScoreSection

if TYPE_CHECKING:
    from spotlight.rewards import Reward, RewardContext

PICKSCORE_DIVISOR = 26.0  # flow_grpo's normalisation of PickScore logits
CLIPSCORE_WEIGHT = 2.5  # Hessel et al.'s w

# ------------------------------------------------------------------ PIL's resize, as matrices

_LANCZOS, _BILINEAR, _BICUBIC, _BOX, _HAMMING = 1, 2, 3, 4, 5  # PIL.Image.Resampling values


def _sinc(x: float) -> float:
    return 1.0 if x == 0.0 else math.sin(math.pi * x) / (math.pi * x)


def _bicubic(x: float, a: float = -0.5) -> float:
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    return (((x - 5) * x + 8) * x - 4) * a if x < 2.0 else 0.0


def _hamming(x: float) -> float:
    x = abs(x)
    if x == 0.0:
        return 1.0
    # PIL writes these constants as C floats (0.54f), so they are the float32 values.
    return 0.0 if x >= 1.0 else _sinc(x) * (float(np.float32(0.54)) + float(np.float32(0.46)) * math.cos(math.pi * x))


# PIL's filters (libImaging/Resample.c) with their support, by PIL.Image.Resampling value.
_FILTERS: dict[int, tuple[Callable[[float], float], float]] = {
    _BOX: (lambda x: 1.0 if -0.5 < x <= 0.5 else 0.0, 0.5),
    _BILINEAR: (lambda x: max(0.0, 1.0 - abs(x)), 1.0),
    _HAMMING: (_hamming, 1.0),
    _BICUBIC: (_bicubic, 2.0),
    _LANCZOS: (lambda x: _sinc(x) * _sinc(x / 3) if -3.0 <= x < 3.0 else 0.0, 3.0),
}


def pil_resize_weights(in_size: int, out_size: int, resample: int) -> torch.Tensor:
    """[out_size, in_size] float64: the weights PIL's ``Image.resize`` gives each input pixel of a row.

    Why matrices: the reward's image module must export and compile; two matmuls with these fixed
    weights are PIL's separable resampling (``precompute_coeffs``), antialiasing included.
    """
    if resample not in _FILTERS:
        raise ValueError(f"PIL resample filter {resample!r} is not supported; supported: {sorted(_FILTERS)} "
                         "(lanczos, bilinear, bicubic, box, hamming)")
    if in_size == out_size:  # PIL copies
        return torch.eye(in_size, dtype=torch.float64)
    weights = torch.zeros(out_size, in_size, dtype=torch.float64)
    scale = in_size / out_size
    kernel, support = _FILTERS[resample]
    filterscale = max(scale, 1.0)  # downscaling widens the kernel: antialiasing
    support *= filterscale
    for i in range(out_size):
        center = (i + 0.5) * scale
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), in_size)
        w = torch.tensor([kernel((j - center + 0.5) / filterscale) for j in range(lo, hi)], dtype=torch.float64)
        weights[i, lo:hi] = w / w.sum() if w.sum() != 0 else w
    return weights


def _center_crop_rows(weights: torch.Tensor, crop: int) -> torch.Tensor:
    """Rows of the center crop transformers takes of a resized axis; rows it pads with zeros stay zero."""
    n = weights.shape[0]
    start = (n - crop) // 2
    out = weights.new_zeros(crop, weights.shape[1])
    for i in range(crop):
        if 0 <= start + i < n:
            out[i] = weights[start + i]
    return out


class ClipImagePreprocess(nn.Module):
    """[B, C, H, W] in [-1, 1] -> the ``pixel_values`` a transformers CLIP image processor makes (PIL path).

    ``processor`` is the image processor (its resize size, resample filter, crop, rescale and
    normalisation settings are read once); ``item_shape`` is the fixed [C, H, W] of the policy's images.
    """

    def __init__(self, processor: Any, item_shape: tuple[int, int, int]):
        super().__init__()
        channels, height, width = item_shape
        if channels not in (1, 3):
            raise ValueError(f"CLIP rewards score grey or RGB images; got {channels} channels")
        rows, cols = torch.eye(height, dtype=torch.float64), torch.eye(width, dtype=torch.float64)
        if processor.do_resize:
            # The processor's own rule for the resized size (shortest edge, fixed size, ...), on a blank image.
            resample = 2 if processor.resample is None else int(processor.resample)  # its default: bilinear
            resized = processor.resize(np.zeros((3, height, width), np.uint8), size=processor.size, resample=resample)
            rows = pil_resize_weights(height, resized.shape[-2], resample)
            cols = pil_resize_weights(width, resized.shape[-1], resample)
        if processor.do_center_crop:
            rows = _center_crop_rows(rows, processor.crop_size.height)
            cols = _center_crop_rows(cols, processor.crop_size.width)
        self.channels = channels
        self.register_buffer("rows", rows.float())  # [h, H]: the vertical pass
        self.register_buffer("cols", cols.T.contiguous().float())  # [W, w]: the horizontal pass
        scale = processor.rescale_factor if processor.do_rescale else 1.0
        mean = torch.tensor(processor.image_mean if processor.do_normalize else [0.0] * 3).view(1, 3, 1, 1)
        std = torch.tensor(processor.image_std if processor.do_normalize else [1.0] * 3).view(1, 3, 1, 1)
        # (pixel * scale - mean) / std, folded into one multiply-add.
        self.register_buffer("gain", (scale / std).float())
        self.register_buffer("offset", (-mean / std).float())

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = ((images.clamp(-1, 1) + 1) * 127.5).round()  # the 8-bit image
        if self.channels == 1:
            pixels = pixels.expand(-1, 3, -1, -1)
        pixels = (pixels @ self.cols).clamp(0, 255)  # PIL: horizontal pass first, clipped to 8-bit range
        pixels = (self.rows @ pixels).clamp(0, 255)
        return pixels * self.gain + self.offset


class AestheticHead(nn.Module):
    """The LAION aesthetic predictor v2 MLP (``layers.N`` keys of ``sac+logos+ava1-l14-linearMSE.pth``)."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
            nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1),
        )

    def forward(self, embeds: torch.Tensor) -> torch.Tensor:
        return self.layers(embeds)


class ClipImageEmbedder(nn.Module):
    """Images -> L2-normalised CLIP image embeddings [B, D] (or, with a head, its score [B]): one module."""

    def __init__(self, clip: nn.Module, preprocess: ClipImagePreprocess, head: AestheticHead | None = None):
        super().__init__()
        self.preprocess, self.vision, self.projection = preprocess, clip.vision_model, clip.visual_projection
        self.head = head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pooled = self.vision(pixel_values=self.preprocess(images)).pooler_output
        embeds = F.normalize(self.projection(pooled), dim=-1)
        return embeds if self.head is None else self.head(embeds).squeeze(-1)


class ClipTextEmbeddings:
    """Prompt -> L2-normalised CLIP text embedding, computed once per prompt (batch 1: batch-independent bits)."""

    def __init__(self, clip: nn.Module, tokenizer: Any, device: torch.device):
        self.text_model, self.projection = clip.text_model.to(device), clip.text_projection.to(device)
        self.tokenizer, self.device = tokenizer, device
        self.max_length = min(tokenizer.model_max_length, clip.config.text_config.max_position_embeddings)
        self.cache: dict[str, torch.Tensor] = {}

    def __call__(self, prompts: Sequence[str]) -> torch.Tensor:
        for prompt in dict.fromkeys(p for p in prompts if p not in self.cache):
            tokens = self.tokenizer(prompt, truncation=True, max_length=self.max_length, return_tensors="pt")
            with torch.inference_mode():
                pooled = self.text_model(input_ids=tokens["input_ids"].to(self.device),
                                         attention_mask=tokens["attention_mask"].to(self.device)).pooler_output
                self.cache[prompt] = F.normalize(self.projection(pooled), dim=-1)[0].float().cpu()
        return torch.stack([self.cache[p] for p in prompts])


class ClipSimilarityReward:
    """``weight * cos(image, prompt)`` in CLIP space (clipped at 0 for CLIPScore)."""

    def __init__(self, name: str, scorer: Callable[[torch.Tensor], torch.Tensor], text: ClipTextEmbeddings,
                 weight: float, clip_at_zero: bool):
        self.name, self.scorer, self.text, self.weight, self.clip_at_zero = name, scorer, text, weight, clip_at_zero

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        cos = (self.scorer(images) * self.text(prompts)).sum(-1)
        return (self.weight * (cos.clamp_min(0) if self.clip_at_zero else cos)).float()


class AestheticReward:
    """The LAION aesthetic predictor's score of each image (prompts are not used)."""

    def __init__(self, name: str, scorer: Callable[[torch.Tensor], torch.Tensor]):
        self.name, self.scorer = name, scorer

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        return self.scorer(images).float()


# ------------------------------------------------------------------ loading


def _load_clip(path: str) -> nn.Module:
    from transformers import CLIPModel

    # fp32 whatever the checkpoint's dtype; local_files_only: a path, never a hub download.
    return CLIPModel.from_pretrained(path, dtype=torch.float32, local_files_only=True).eval().requires_grad_(False)


def _image_processor(path: str) -> Any:
    # The PIL-backend class reads the same preprocessor config as CLIPImageProcessor, without torchvision.
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(path, local_files_only=True)


def load_aesthetic_head(path: str | Path, dim: int) -> AestheticHead:
    """The LAION head from a ``.pth`` state dict or ``.safetensors``; its input must be ``dim`` (the CLIP's)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        state = torch.load(path, map_location="cpu", weights_only=True)
    head = AestheticHead(dim)
    expected = set(head.state_dict())
    if not isinstance(state, dict) or set(state) != expected:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not a LAION aesthetic head: keys {got}, expected {sorted(expected)}")
    if state["layers.0.weight"].shape[1] != dim:
        raise ValueError(f"{path} takes {state['layers.0.weight'].shape[1]}-dim CLIP embeddings, but the CLIP "
                         f"model (rewards.aesthetic.clip_model) makes {dim}-dim ones")
    head.load_state_dict(state)
    return head.eval().requires_grad_(False)


def _clip_parts(ctx: RewardContext, name: str, model: str, processor: str) -> tuple[nn.Module, Any, ClipTextEmbeddings]:
    """The CLIP, its image side on the configured runtime, and its cached text side."""
    from transformers import AutoTokenizer

    clip = _load_clip(model)
    embedder = ClipImageEmbedder(clip, ClipImagePreprocess(_image_processor(processor), ctx.image_shape))
    text = ClipTextEmbeddings(clip, AutoTokenizer.from_pretrained(processor, local_files_only=True), ctx.device)
    return clip, ctx.scorer(embedder, ctx.image_shape, name), text


def build_pickscore(ctx: RewardContext, name: str) -> Reward:
    section = ctx.cfg.rewards.pickscore
    clip, scorer, text = _clip_parts(ctx, name, section.model, section.processor or section.model)
    return ClipSimilarityReward(name, scorer, text, clip.logit_scale.exp().item() / PICKSCORE_DIVISOR,
                                clip_at_zero=False)


def build_clip_score(ctx: RewardContext, name: str) -> Reward:
    section = ctx.cfg.rewards.clip_score
    _, scorer, text = _clip_parts(ctx, name, section.model, section.model)
    return ClipSimilarityReward(name, scorer, text, CLIPSCORE_WEIGHT, clip_at_zero=True)


def build_aesthetic(ctx: RewardContext, name: str) -> Reward:
    section = ctx.cfg.rewards.aesthetic
    clip = _load_clip(section.clip_model)
    head = load_aesthetic_head(section.head, clip.config.projection_dim)
    embedder = ClipImageEmbedder(clip, ClipImagePreprocess(_image_processor(section.clip_model), ctx.image_shape),
                                 head)
    return AestheticReward(name, ctx.scorer(embedder, ctx.image_shape, name))


# ------------------------------------------------------------------ preflight

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def _folder(key: str, path: str) -> Path:
    folder = Path(path)
    if not folder.is_dir():
        raise ConfigError(f"{key}: {path} does not exist (or is not a folder)")
    return folder


def _check_model(key: str, path: str) -> None:
    folder = _folder(key, path)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"{key}: {folder / 'config.json'} is missing ({path} is not a transformers model folder)")
    if not any((folder / w).is_file() for w in _WEIGHTS):
        raise ConfigError(f"{key}: {path} has no weights (none of {', '.join(_WEIGHTS)})")


def _check_processor(key: str, path: str, tokenizer: bool) -> None:
    folder = _folder(key, path)
    if not any((folder / f).is_file() for f in ("preprocessor_config.json", "processor_config.json")):
        raise ConfigError(f"{key}: {folder / 'preprocessor_config.json'} is missing (the CLIP image processor)")
    if tokenizer and not ((folder / "tokenizer.json").is_file()
                          or all((folder / f).is_file() for f in ("vocab.json", "merges.txt"))):
        raise ConfigError(f"{key}: {path} has no CLIP tokenizer (tokenizer.json, or vocab.json + merges.txt)")


def check_pickscore(section: PickScoreSection) -> None:
    _check_model("rewards.pickscore.model", section.model)
    key = "rewards.pickscore.processor" if section.processor else "rewards.pickscore.model"
    _check_processor(key, section.processor or section.model, tokenizer=True)


def check_clip_score(section: ClipScoreSection) -> None:
    _check_model("rewards.clip_score.model", section.model)
    _check_processor("rewards.clip_score.model", section.model, tokenizer=True)


def check_aesthetic(section: AestheticSection) -> None:
    _check_model("rewards.aesthetic.clip_model", section.clip_model)
    _check_processor("rewards.aesthetic.clip_model", section.clip_model, tokenizer=False)
    head = Path(section.head)
    if not head.is_file():
        raise ConfigError(f"rewards.aesthetic.head: {section.head} does not exist")
    if head.suffix not in (".pth", ".pt", ".bin", ".safetensors"):
        raise ConfigError(f"rewards.aesthetic.head: {section.head} is neither a torch state dict (.pth) "
                          "nor .safetensors")
