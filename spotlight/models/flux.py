"""FLUX.1 (diffusers ``FluxPipeline``: dev, schnell) behind the policy seam.

What the pipeline does, and so what this does:

- Prompts: ``encode_prompt`` = T5-XXL's ``max_sequence_length`` tokens and CLIP-L's pooled output.
  -> ``{"tokens": [B, L, 4096], "pooled": [B, 768]}``; text ids are zeros ``[L, 3]``.
- Latents: the policy's latents are UNPACKED ``[C, h, w]`` per sample (the sampler's noise and
  log-probs live there); the transformer sees them packed into 2x2 patches ``[B, h/2 * w/2, 4C]``
  with image ids (row, column) per patch, and its output is unpacked again.
- Velocity: ``transformer(timestep=sigma, ...)`` (the pipeline passes ``t / 1000``; the transformer
  multiplies by 1000 itself). Ids are built in fp32 (the pipeline uses the latents' dtype; the
  transformer's RoPE casts them to float64 either way, and bf16 is not exact above 256).
- Guidance: FLUX.1-dev is guidance-distilled (``transformer.config.guidance_embeds``): the scale is
  an input, one pass per step, no unconditional prompt (``embedded_guidance = True``). Without it
  (schnell-like) guidance > 1 is true CFG through the base class, the conditional and
  unconditional passes batched together (the pipeline runs them one after the other).
- Decode: unpacked latents ``/ scaling_factor + shift_factor`` through the VAE, clamped to [-1, 1].
- Sigmas: ``linspace(1, 1/N, N)`` given to ``set_timesteps(sigmas=..., mu=calculate_shift(h/2 * w/2))``
  (the resolution-dependent dynamic shift); ``sampler.shift`` replaces it with a static shift.
"""

from __future__ import annotations

import numpy as np
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from spotlight.config import PipelineModelSection
from spotlight.models.pipeline_policy import FrozenParts, PipelinePolicy
from spotlight.models.policy import PromptEmbeds


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, h, w]`` -> ``[B, h/2 * w/2, 4C]``: 2x2 patches as tokens (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """Inverse of :func:`pack_latents` for a latent grid of ``h x w``."""
    b, _, d = tokens.shape
    tokens = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return tokens.reshape(b, d // 4, h, w)


def packed_sigmas(scheduler: FlowMatchEulerDiscreteScheduler, latent_shape: tuple[int, int, int],
                  steps: int) -> torch.Tensor:
    """``linspace(1, 1/N, N)`` with the dynamic shift of a 2x2-packed ``[C, h, w]`` latent, as FLUX's and
    Qwen-Image's pipelines set them (``mu`` is ignored when ``sampler.shift`` turned dynamic shifting off)."""
    config = scheduler.config
    _, h, w = latent_shape
    mu = calculate_shift((h // 2) * (w // 2), config.get("base_image_seq_len", 256),
                         config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                         config.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), device="cpu", mu=mu)
    return scheduler.sigmas.float().cpu()


class FluxPolicy(PipelinePolicy):
    """FLUX.1: packed latents, timestep = sigma, distilled (embedded) guidance or true CFG."""

    pipeline_cls = FluxPipeline
    transformer_cls = FluxTransformer2DModel

    def __init__(self, frozen: FrozenParts, transformer: FluxTransformer2DModel, model: PipelineModelSection,
                 shift: float | None) -> None:
        super().__init__(frozen, transformer, model, shift)
        side = self.check_resolution(model.resolution, self.pipe.vae_scale_factor * 2)
        self.latent_shape = (transformer.config.in_channels // 4, side, side)
        self.embedded_guidance = bool(transformer.config.guidance_embeds)

    def encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        tokens, pooled, _ = self.pipe.encode_prompt(prompt=[prompt], prompt_2=None, device=self.text_device(),
                                                    max_sequence_length=self.max_sequence_length)
        return {"tokens": tokens, "pooled": pooled}

    def prompt_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        config = self.core.config
        return {"tokens": ((self.max_sequence_length, config.joint_attention_dim), self.text_dtype()),
                "pooled": ((config.pooled_projection_dim,), self.text_dtype())}

    def text_lengths(self) -> dict[str, int]:
        return {"text_encoder": self.pipe.tokenizer_max_length, "text_encoder_2": self.max_sequence_length}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds,
                 guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = latents.shape
        dtype, device = self.compute_dtype, latents.device
        tokens = prompt.tensors["tokens"]
        guidance_in = torch.full((b,), guidance, device=device, dtype=torch.float32) if self.embedded_guidance else None
        with self.autocast():
            v = self.transformer(
                hidden_states=pack_latents(latents).to(dtype),
                timestep=sigma.expand(b).to(dtype),
                guidance=guidance_in,
                pooled_projections=prompt.tensors["pooled"].to(dtype),
                encoder_hidden_states=tokens.to(dtype),
                txt_ids=torch.zeros(tokens.shape[1], 3, device=device),
                img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, device, torch.float32),
                return_dict=False,
            )[0]
        return unpack_latents(v.float(), h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    def sigmas(self, steps: int) -> torch.Tensor:
        return packed_sigmas(self.scheduler, self.latent_shape, steps)
