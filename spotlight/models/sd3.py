"""Stable Diffusion 3 / 3.5 (diffusers ``StableDiffusion3Pipeline``) behind the policy seam.

What the pipeline does, and so what this does:

- Prompts: ``encode_prompt`` = CLIP-L and CLIP-G penultimate hidden states (77 tokens, concatenated
  on features, zero-padded to T5's width) followed by T5-XXL's ``max_sequence_length`` tokens;
  pooled = both CLIPs' projected EOS features. -> ``{"tokens": [B, 77 + L, D], "pooled": [B, P]}``.
- Velocity: ``transformer(hidden_states, timestep=sigma * 1000, encoder_hidden_states,
  pooled_projections)``; latents are ``[C, H/8, W/8]``, not packed.
- CFG: ``uncond + g * (cond - uncond)`` (the base class's form).
- Decode: ``vae.decode(latents / scaling_factor + shift_factor)``, clamped to [-1, 1].
- Sigmas: ``FlowMatchEulerDiscreteScheduler.set_timesteps(steps)`` from the pipeline's scheduler
  config (SD3.5: static shift 3.0), with ``mu`` from the latent token count if the config asks for
  dynamic shifting, as the pipeline computes it; ``sampler.shift`` replaces the shift.

Measured against the pipeline itself (tests/test_pipelines.py, tiny SD3.5-style pipeline with qk RMS
norm and a dual-attention layer, fp32 CPU, guidance 4.5, 4 steps): ODE latents within 2.2e-6, images
within 1e-6. Same ops in the same order as the pipeline (timestep = the scheduler's sigma * 1000 in
fp32, Euler step x + (sigma_next - sigma) * v); the residue comes from batching cond before uncond.
"""

from __future__ import annotations

import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from spotlight.config import ConfigError, PipelineModelSection
from spotlight.models.pipeline_policy import FrozenParts, PipelinePolicy
from spotlight.models.policy import PromptEmbeds


class SD3Policy(PipelinePolicy):
    """SD3/SD3.5: MMDiT on unpacked VAE latents, timestep = sigma * 1000, true CFG."""

    pipeline_cls = StableDiffusion3Pipeline
    transformer_cls = SD3Transformer2DModel

    def __init__(self, frozen: FrozenParts, transformer: SD3Transformer2DModel, model: PipelineModelSection,
                 shift: float | None) -> None:
        super().__init__(frozen, transformer, model, shift)
        config = transformer.config
        side = self.check_resolution(model.resolution, self.pipe.vae_scale_factor * config.patch_size)
        if side // config.patch_size > config.pos_embed_max_size:
            largest = config.pos_embed_max_size * config.patch_size * self.pipe.vae_scale_factor
            raise ConfigError(f"model.resolution {model.resolution} is larger than this SD3 transformer's positional "
                              f"grid allows ({largest} px)")
        self.latent_shape = (config.in_channels, side, side)

    def encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        tokens, _, pooled, _ = self.pipe.encode_prompt(
            prompt=[prompt], prompt_2=None, prompt_3=None, device=self.text_device(),
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return {"tokens": tokens, "pooled": pooled}

    def prompt_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        config, clip_tokens = self.core.config, self.pipe.tokenizer_max_length
        return {"tokens": ((clip_tokens + self.max_sequence_length, config.joint_attention_dim), self.text_dtype()),
                "pooled": ((config.pooled_projection_dim,), self.text_dtype())}

    def text_lengths(self) -> dict[str, int]:
        clip_tokens = self.pipe.tokenizer_max_length
        return {"text_encoder": clip_tokens, "text_encoder_2": clip_tokens, "text_encoder_3": self.max_sequence_length}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds,
                 guidance: float = 1.0) -> torch.Tensor:
        dtype = self.compute_dtype
        with self.autocast():
            v = self.transformer(
                hidden_states=latents.to(dtype),
                timestep=sigma.expand(len(latents)) * 1000.0,
                encoder_hidden_states=prompt.tensors["tokens"].to(dtype),
                pooled_projections=prompt.tensors["pooled"].to(dtype),
                return_dict=False,
            )[0]
        return v.float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        latents = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        return vae.decode(latents, return_dict=False)[0].float().clamp(-1, 1)

    def sigmas(self, steps: int) -> torch.Tensor:
        config = self.scheduler.config
        kwargs = {}
        if config.get("use_dynamic_shifting", False):
            _, h, w = self.latent_shape
            patch = self.core.config.patch_size
            kwargs["mu"] = calculate_shift((h // patch) * (w // patch), config.get("base_image_seq_len", 256),
                                           config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                                           config.get("max_shift", 1.16))
        self.scheduler.set_timesteps(steps, device="cpu", **kwargs)
        return self.scheduler.sigmas.float().cpu()
