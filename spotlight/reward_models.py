"""Reward models built in plain torch, sized from a config.

Why: reward-runtime choices only transfer to production if they are measured on a model of
realistic size (ViT-B/16: ~86M parameters, ~17.6 GFLOPs per 224x224 image), while tests need the
same architecture at toy size. No `transformers` dependency: the tower is ~60 lines of torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ViTConfig:
    """Shape of a ViT image reward model; defaults are ViT-B/16 on 224x224x3."""

    image_size: int = 224
    patch_size: int = 16
    channels: int = 3
    dim: int = 768
    depth: int = 12
    heads: int = 12
    mlp_dim: int = 3072
    num_classes: int = 1000

    @property
    def item_shape(self) -> tuple[int, int, int]:
        return (self.channels, self.image_size, self.image_size)

    @property
    def forward_flops(self) -> int:
        """FLOPs of one image's forward in its matmuls (patch embedding, qkv/out projections, MLP,
        attention scores and values): the work no runtime can skip, for roofline comparisons."""
        n, d = (self.image_size // self.patch_size) ** 2 + 1, self.dim
        per_block = 2 * n * (4 * d * d + 2 * d * self.mlp_dim) + 4 * n * n * d
        return self.depth * per_block + 2 * (n - 1) * d * self.channels * self.patch_size**2


VIT_B16 = ViTConfig()
VIT_TINY = ViTConfig(image_size=32, patch_size=8, dim=64, depth=2, heads=4, mlp_dim=128, num_classes=10)


class _Block(nn.Module):
    """Pre-LN transformer block (as in ViT)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class ViTRewardModel(nn.Module):
    """ViT vision tower + linear head; returns class probabilities [B, num_classes].

    Why probabilities: reward functions consume bounded scores (e.g. P(target class)), and a
    bounded output makes an absolute fp32 parity tolerance meaningful across runtimes.
    """

    def __init__(self, cfg: ViTConfig = VIT_B16) -> None:
        super().__init__()
        if cfg.image_size % cfg.patch_size or cfg.dim % cfg.heads:
            raise ValueError(f"inconsistent ViT config: {cfg}")
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch_size) ** 2
        self.patch_embed = nn.Conv2d(cfg.channels, cfg.dim, cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.randn(1, n_patches + 1, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=1e-6)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0])).softmax(dim=-1)


def build_vit(cfg: ViTConfig = VIT_B16, seed: int = 0) -> ViTRewardModel:
    """Deterministically initialised model in eval mode, without touching the global RNG.

    The head is initialised so logits have std ~3: peaked probabilities like a trained
    classifier's, so parity errors are not hidden by a near-uniform softmax.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ViTRewardModel(cfg)
        nn.init.normal_(model.head.weight, std=3.0 / cfg.dim**0.5)
    return model.eval()
