"""The model sections: which policy, its architecture or pretrained folder, LoRA, precision. What the
memory planner reads to size a worker."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from spotlight.config.base import Section


class LoraSection(Section):
    """A LoRA adapter on the transformer (peft): the run store then holds only the adapter per iteration."""

    rank: int = Field(32, ge=1)
    alpha: float = Field(64.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = Field(("to_q", "to_k", "to_v", "to_out.0"), min_length=1,
                                            description="module-name suffixes, as peft matches them")


class _ModelCommon(Section):
    lora: LoraSection | None = Field(None, description="train a LoRA adapter; null: full fine-tuning")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights' dtype: auto is bfloat16 on CUDA (autocast; log-probs and loss in fp32), else float32")
    gradient_checkpointing: bool = False


class TinyModelSection(_ModelCommon):
    """A tiny SD3-style MMDiT (diffusers SD3Transformer2DModel) on 1x16x16 pixels: the embedded default."""

    kind: Literal["tiny-mmdit"] = "tiny-mmdit"
    sample_size: int = 16
    in_channels: int = 1
    patch_size: int = 4
    num_layers: int = 3
    num_attention_heads: int = 4
    attention_head_dim: int = 32
    prompt_tokens: int = 4
    joint_attention_dim: int = 64
    pooled_projection_dim: int = 64

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """What the policy decodes: pixel space, so the latent shape."""
        return (self.in_channels, self.sample_size, self.sample_size)


class PipelineModelSection(_ModelCommon):
    """A diffusers pipeline loaded with ``from_pretrained(pretrained)``: SD3/SD3.5, FLUX.1 or Qwen-Image."""

    kind: Literal["sd3", "flux", "qwen-image"]
    pretrained: str = Field(description="a diffusers pipeline folder: a local path or a mounted bucket")
    architecture: str | None = Field(None, description="the published architecture this pipeline is "
                                     "(configs/architectures/<name>, e.g. sd3.5-medium): what the memory plan reads "
                                     "when model.pretrained is not on this machine")
    resolution: int = Field(512, ge=16, description="image height and width")
    max_sequence_length: int = Field(256, ge=1, description="text tokens (T5 / Qwen2.5-VL)")
    vae_fp32: bool = Field(True, description="the VAE in fp32 whatever model.dtype (flow_grpo's): rollouts and "
                           "evaluations are decoded for their rewards at full precision; false: in model.dtype")

    @field_validator("pretrained")
    @classmethod
    def _local(cls, path: str) -> str:
        if "://" in path:
            raise ValueError(f"{path!r} is a URL; give a local path (or a bucket mounted on this machine): "
                             "weights are never downloaded at run time")
        return path

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """What the pipeline's VAE decodes: RGB at the configured resolution."""
        return (3, self.resolution, self.resolution)


ModelSection = Annotated[TinyModelSection | PipelineModelSection, Field(discriminator="kind")]

