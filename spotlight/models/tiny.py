"""The embedded default policy: a ~2M-parameter SD3-style MMDiT on 1x16x16 digit images, built from a config.

Pixel space (no VAE), a frozen random embedding per digit prompt standing in for the text encoders,
and SD3's sigma schedule as its pipeline computes it (diffusers' FlowMatchEulerDiscreteScheduler with
static shift 3.0). It implements the same :class:`~spotlight.models.policy.Policy`
seam as the diffusers pipelines, so every RL feature (LoRA, CFG, data parallel) runs on it too.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
from torch import nn

from spotlight.config import Config, TinyModelSection
from spotlight.data import DIGIT_PROMPTS, NULL_PROMPT
from spotlight.models.policy import DiffusionPolicy, PromptEmbeds

DEFAULT_SHIFT = 3.0  # SD3's


@lru_cache(maxsize=32)
def _scheduler_sigmas(steps: int, shift: float) -> tuple[float, ...]:
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)  # SD3's: 1000 training timesteps, static shift
    scheduler.set_timesteps(steps, device="cpu")
    return tuple(scheduler.sigmas.tolist())


def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """``steps + 1`` noise levels from 1 to 0, exactly as SD3's pipeline gets them:
    ``FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(steps).sigmas``, i.e. the timestep
    shift ``s*t / (1 + (s-1)*t)`` of ``linspace(1, 1/1000, steps)``, then a final 0.

    The last step therefore starts at sigma ~0.009 (shift 3), so the SDE's last step adds noise of
    std ~0.006 to the sample the reward scores. (The former ``linspace(1, 0, steps + 1)`` form, FLUX's,
    started the last step at sigma 0.25 and added noise of std ~0.2.)"""
    return torch.tensor(_scheduler_sigmas(steps, float(shift)), dtype=torch.float32)


class FrozenPromptEncoder(nn.Module):
    """Stands in for a frozen text encoder: a fixed random embedding per known prompt (10 digits + null)."""

    def __init__(self, cfg: TinyModelSection, seed: int = 1234):
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
        return PromptEmbeds({"tokens": self.tokens[idx], "pooled": self.pooled[idx]})


class TinyMMDiT(DiffusionPolicy):
    """diffusers SD3Transformer2DModel at toy size, pixel space, timestep = sigma * 1000 (as SD3)."""

    def __init__(self, cfg: TinyModelSection, shift: float = DEFAULT_SHIFT):
        super().__init__()
        self.latent_shape = (cfg.in_channels, cfg.sample_size, cfg.sample_size)
        self.shift = shift
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

    @classmethod
    def build(cls, cfg: Config, device: torch.device = torch.device("cpu")) -> "TinyMMDiT":
        """Random weights on the CPU (build_policy moves them to ``device``): the run loads the
        pretrained base (or theta_t) into them."""
        return cls(cfg.model, cfg.sampler.shift or DEFAULT_SHIFT)

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        return self.prompt_encoder(prompts)

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {"prompt_encoder": self.prompt_encoder}

    def prompt_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        enc = self.prompt_encoder
        return {"tokens": (tuple(enc.tokens.shape[1:]), enc.tokens.dtype),
                "pooled": (tuple(enc.pooled.shape[1:]), enc.pooled.dtype)}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds,
                 guidance: float = 1.0) -> torch.Tensor:
        timestep = sigma.expand(latents.shape[0]) * 1000.0
        return self.transformer(
            hidden_states=latents,
            encoder_hidden_states=prompt.tensors["tokens"],
            pooled_projections=prompt.tensors["pooled"],
            timestep=timestep,
            return_dict=False,
        )[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.clamp(-1, 1)

    def sigmas(self, steps: int) -> torch.Tensor:
        return shifted_sigmas(steps, self.shift)
