"""Qwen-Image (diffusers ``QwenImagePipeline``) behind the policy seam.

What the pipeline does, and so what this does:

- Prompts: ``encode_prompt`` runs Qwen2.5-VL on a chat template, drops the template's first 34
  tokens and keeps the last hidden state of the rest, truncated to ``max_sequence_length``. The
  pipeline pads a batch to its longest prompt (and drops the mask when nothing is padded), so a
  prompt's conditioning would depend on its batch-mates; here every prompt is encoded alone and
  zero-padded to a FIXED ``model.max_sequence_length`` with its mask (1 = token, 0 = padding):
  ``{"tokens": [B, L, D], "mask": [B, L] int64}``. The transformer builds its joint attention mask
  from ``encoder_hidden_states_mask`` (padded keys are never attended) and its text RoPE positions
  start at 0 whatever the padding, so the image tokens' output equals the unpadded one's to float
  tolerance, and each row is independent of the batch it sits in (tests/test_pipelines.py).
- Latents: UNPACKED ``[C, h, w]`` per sample; packed 2x2 (as FLUX) for the transformer, with
  ``img_shapes = [(1, h/2, w/2)]`` per sample for its 3D RoPE.
- Velocity: ``transformer(timestep=sigma, encoder_hidden_states_mask=mask, img_shapes=...)``.
- CFG (``true_cfg_scale``): norm-preserving, ``comb = uncond + g * (cond - uncond)`` rescaled per
  packed token to the conditional prediction's norm (over the 4C packed features), so
  :meth:`combine_guidance` is overridden and works in packed space.
- Decode: ``AutoencoderKLQwenImage`` is a video VAE: latents get a frame axis ``[B, C, 1, h, w]``,
  are un-normalised with ``latents_mean`` / ``latents_std`` exactly as the pipeline does
  (``z / (1 / std) + mean``) and frame 0 of the output is the image, clamped to [-1, 1].
- Sigmas: ``linspace(1, 1/N, N)`` with the dynamic shift ``mu = calculate_shift(h/2 * w/2)`` from
  the scheduler config (Qwen-Image: max_shift 0.9, max_image_seq_len 8192).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel

from spotlight.config import PipelineModelSection
from spotlight.models.flux import pack_latents, packed_sigmas, unpack_latents  # same 2x2 packing as FLUX
from spotlight.models.pipeline_policy import FrozenParts, PipelinePolicy
from spotlight.models.policy import PromptEmbeds


class QwenImagePolicy(PipelinePolicy):
    """Qwen-Image: packed latents, fixed-length masked text, timestep = sigma, norm-preserving true CFG."""

    pipeline_cls = QwenImagePipeline
    transformer_cls = QwenImageTransformer2DModel
    max_text_tokens = 1024

    def __init__(self, frozen: FrozenParts, transformer: QwenImageTransformer2DModel,
                 model: PipelineModelSection, shift: float | None) -> None:
        super().__init__(frozen, transformer, model, shift)
        side = self.check_resolution(model.resolution, self.pipe.vae_scale_factor * 2)
        self.latent_shape = (transformer.config.in_channels // 4, side, side)

    def encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        tokens, mask = self.pipe.encode_prompt(prompt=[prompt], device=self.text_device(),
                                               max_sequence_length=self.max_sequence_length)
        n = tokens.shape[1]
        if mask is None:  # the pipeline drops an all-ones mask
            mask = torch.ones(1, n, dtype=torch.long, device=tokens.device)
        pad = self.max_sequence_length - n
        return {"tokens": F.pad(tokens, (0, 0, 0, pad)), "mask": F.pad(mask.long(), (0, pad))}

    def prompt_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"tokens": ((self.max_sequence_length, self.core.config.joint_attention_dim), self.text_dtype()),
                "mask": ((self.max_sequence_length,), torch.long)}

    def text_lengths(self) -> dict[str, int]:
        """At most: the pipeline tokenizes the templated prompt up to its own limit plus the template's prefix
        (dropped after encoding), and truncates to ``max_sequence_length`` only the embeddings."""
        return {"text_encoder": self.pipe.tokenizer_max_length + self.pipe.prompt_template_encode_start_idx}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds,
                 guidance: float = 1.0) -> torch.Tensor:
        b, _, h, w = latents.shape
        dtype = self.compute_dtype
        with self.autocast():
            v = self.transformer(
                hidden_states=pack_latents(latents).to(dtype),
                timestep=sigma.expand(b).to(dtype),
                encoder_hidden_states=prompt.tensors["tokens"].to(dtype),
                encoder_hidden_states_mask=prompt.tensors["mask"],
                img_shapes=[[(1, h // 2, w // 2)]] * b,
                return_dict=False,
            )[0]
        return unpack_latents(v.float(), h, w)

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float) -> torch.Tensor:
        """QwenImagePipeline's true CFG: the combination rescaled to the conditional prediction's norm
        per packed token."""
        h, w = v_cond.shape[-2:]
        cond, uncond = pack_latents(v_cond), pack_latents(v_uncond)
        comb = uncond + guidance * (cond - uncond)
        comb = comb * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
        return unpack_latents(comb, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipe.vae
        z = latents.unsqueeze(2).to(vae.dtype)  # a one-frame video
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        image = vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]
        return image.float().clamp(-1, 1)

    def sigmas(self, steps: int) -> torch.Tensor:
        return packed_sigmas(self.scheduler, self.latent_shape, steps)
