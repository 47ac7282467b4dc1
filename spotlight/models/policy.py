"""The policy seam, and a tiny SD3-style MMDiT that implements it.

The RL code only needs two things from a diffusion policy: turn prompts into conditioning, and
predict the rectified-flow velocity ``v = noise - x0`` at noise level sigma. A real SD3.5 / FLUX /
Qwen-Image pipeline implements the same :class:`Policy` protocol by wrapping its text encoders
(``encode_prompts``), its transformer (``velocity``, with ``timestep = sigma * 1000``) and its VAE
(``decode``); latents then live in VAE space instead of pixels. Everything else (sampler, GRPO,
exploration, store) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
from diffusers import SD3Transformer2DModel
from torch import nn

from spotlight.config import ModelSection
from spotlight.data import DIGIT_PROMPTS, NULL_PROMPT


@dataclass
class PromptEmbeds:
    tokens: torch.Tensor  # [B, L, joint_attention_dim]
    pooled: torch.Tensor  # [B, pooled_projection_dim]

    def __getitem__(self, idx) -> "PromptEmbeds":
        return PromptEmbeds(self.tokens[idx], self.pooled[idx])

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        return PromptEmbeds(torch.cat([p.tokens for p in parts]), torch.cat([p.pooled for p in parts]))


class Policy(Protocol):
    latent_shape: tuple[int, ...]
    device: torch.device  # where latents live; rollout noise is drawn on the CPU and moved here

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds: ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds) -> torch.Tensor: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...


class FrozenPromptEncoder(nn.Module):
    """Stands in for a frozen text encoder: a fixed random embedding per known prompt (10 digits + null)."""

    def __init__(self, cfg: ModelSection, seed: int = 1234):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab = (*DIGIT_PROMPTS, NULL_PROMPT)
        n = len(self.vocab)
        self.register_buffer("tokens", torch.randn(n, cfg.prompt_tokens, cfg.joint_attention_dim, generator=g))
        self.register_buffer("pooled", torch.randn(n, cfg.pooled_projection_dim, generator=g))

    def forward(self, prompts: Sequence[str]) -> PromptEmbeds:
        unknown = [p for p in prompts if p not in self.vocab]
        if unknown:
            raise ValueError(f"prompt(s) the tiny encoder does not know: {unknown[:3]}")
        idx = torch.tensor([self.vocab.index(p) for p in prompts], device=self.tokens.device)
        return PromptEmbeds(self.tokens[idx], self.pooled[idx])


class TinyMMDiT(nn.Module):
    """~2M-parameter MMDiT built from a config (diffusers SD3Transformer2DModel), pixel space."""

    def __init__(self, cfg: ModelSection):
        super().__init__()
        self.latent_shape = (cfg.in_channels, cfg.sample_size, cfg.sample_size)
        self.prompt_encoder = FrozenPromptEncoder(cfg)
        self.transformer = SD3Transformer2DModel(
            sample_size=cfg.sample_size,
            patch_size=cfg.patch_size,
            in_channels=cfg.in_channels,
            out_channels=cfg.in_channels,
            num_layers=cfg.num_layers,
            attention_head_dim=cfg.attention_head_dim,
            num_attention_heads=cfg.num_attention_heads,
            joint_attention_dim=cfg.joint_attention_dim,
            caption_projection_dim=cfg.attention_head_dim * cfg.num_attention_heads,
            pooled_projection_dim=cfg.pooled_projection_dim,
            pos_embed_max_size=cfg.sample_size // cfg.patch_size,
        )

    @property
    def device(self) -> torch.device:
        return self.prompt_encoder.tokens.device

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        return self.prompt_encoder(prompts)

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds) -> torch.Tensor:
        timestep = sigma.expand(latents.shape[0]) * 1000.0
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=prompt.tokens,
            pooled_projections=prompt.pooled,
            timestep=timestep,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.clamp(-1, 1)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights RL changes (the frozen prompt encoder is rebuilt from its seed)."""
        return {k: v for k, v in self.transformer.state_dict().items()}

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        self.transformer.load_state_dict(state, strict=True)


def build_policy(cfg: ModelSection) -> TinyMMDiT:
    return TinyMMDiT(cfg)
