"""What the three diffusers-pipeline policies share: loading, the frozen parts, the prompt cache.

The model files (:mod:`spotlight.models.sd3`, ``flux``, ``qwen_image``) hold each pipeline's math
explicitly (prompt encoding, velocity, decode, sigma schedule); this module holds only plumbing:

- **Frozen parts** (text encoders, tokenizers, VAE, scheduler config) are the pipeline loaded with
  ``from_pretrained(pretrained, transformer=None)``, once per process per (pipeline, path, dtype),
  and shared by every policy instance of that path (a run may hold theta_{t-1} for inference and
  theta_t for training); each instance loads and owns its transformer. They are not submodules:
  ``policy.parameters()`` / ``state_dict()`` stay the transformer's, ``deepcopy`` keeps sharing
  them, and ``policy.to(device)`` moves them along.
- **Prompt cache**: prompts repeat every iteration and the text encoders are big, so each prompt is
  encoded alone (batch of one, so its embedding never depends on its batch-mates) and kept on the
  CPU, LRU-bounded; a cached row is the very tensor a fresh encode of that prompt gives.
- **Precision**: ``model.dtype`` auto is bfloat16 on CUDA, float32 elsewhere; velocities come back
  fp32 (the SDE log-prob and the loss stay fp32). ``model.vae_fp32`` keeps the VAE in fp32, as
  flow_grpo does, so the images the rewards score are decoded at full precision.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, ClassVar, Sequence

import torch
from torch import nn

from spotlight.config import Config, ConfigError, PipelineModelSection
from spotlight.models.policy import DiffusionPolicy, PromptEmbeds, check_pretrained

#: prompts whose embeddings a process keeps (per pipeline path and dtype); a T5-XXL row of 256
#: tokens is 2 MB in bf16, so 1024 prompts cost ~2 GB of host memory at most
PROMPT_CACHE_SIZE = 1024

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``model.dtype``: auto is bfloat16 on CUDA (autocast), float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


class FrozenParts:
    """A pipeline without its transformer, frozen and in eval mode, plus its prompt-embedding cache."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.modules = [m for m in pipe.components.values() if isinstance(m, nn.Module)]
        for m in self.modules:
            m.requires_grad_(False).eval()
        self._embeds: OrderedDict[tuple, dict[str, torch.Tensor]] = OrderedDict()

    def __deepcopy__(self, memo: dict) -> "FrozenParts":
        return self  # shared and frozen: a copied policy keeps using the same parts

    def encode(self, prompts: Sequence[str], key: tuple, encode_one: Callable[[str], dict[str, torch.Tensor]]
               ) -> PromptEmbeds:
        """Embeddings of ``prompts``, each encoded alone by ``encode_one`` once and then cached under
        ``(*key, prompt)`` (``key`` names what else the embedding depends on, e.g. the token length)."""
        rows = []
        for prompt in prompts:
            k = (*key, prompt)
            if k in self._embeds:
                self._embeds.move_to_end(k)
            else:
                with torch.no_grad():
                    self._embeds[k] = {n: t.detach().cpu() for n, t in encode_one(prompt).items()}
                if len(self._embeds) > PROMPT_CACHE_SIZE:
                    self._embeds.popitem(last=False)
            rows.append(self._embeds[k])
        return PromptEmbeds({n: torch.cat([r[n] for r in rows]) for n in rows[0]})


_FROZEN: dict[tuple[str, str, torch.dtype, bool], FrozenParts] = {}


def frozen_parts(pipeline_cls: type, pretrained: str, dtype: torch.dtype, vae_fp32: bool = True) -> FrozenParts:
    """The frozen parts of ``pretrained``, loaded on the CPU the first time this process asks; the VAE in
    fp32 when ``vae_fp32``, else in ``dtype`` as the rest."""
    key = (pipeline_cls.__name__, pretrained, dtype, vae_fp32)
    if key not in _FROZEN:
        dtypes = {"default": dtype, "vae": torch.float32} if vae_fp32 else dtype
        pipe = pipeline_cls.from_pretrained(pretrained, transformer=None, torch_dtype=dtypes)
        pipe.set_progress_bar_config(disable=True)
        _FROZEN[key] = FrozenParts(pipe)
    return _FROZEN[key]


class PipelinePolicy(DiffusionPolicy):
    """A diffusers pipeline behind the policy seam; subclasses implement ``encode_one``, ``velocity``,
    ``decode`` and ``sigmas`` and name their pipeline and transformer classes."""

    pipeline_cls: ClassVar[type]
    transformer_cls: ClassVar[type]
    #: the pipeline's own limit on text tokens (its check_inputs)
    max_text_tokens: ClassVar[int] = 512

    def __init__(self, frozen: FrozenParts, transformer: nn.Module, model: PipelineModelSection,
                 shift: float | None) -> None:
        super().__init__()
        self.frozen = frozen
        self.transformer = transformer
        self.compute_dtype = transformer.dtype
        self.max_sequence_length = model.max_sequence_length
        if model.max_sequence_length > self.max_text_tokens:
            raise ConfigError(f"model.max_sequence_length {model.max_sequence_length} exceeds "
                              f"{self.pipeline_cls.__name__}'s limit of {self.max_text_tokens} tokens")
        scheduler = frozen.pipe.scheduler
        # a private scheduler: set_timesteps is stateful; sampler.shift replaces the model's (static or
        # dynamic) shift with a static one
        overrides = {} if shift is None else {"shift": shift, "use_dynamic_shifting": False}
        self.scheduler = type(scheduler).from_config(scheduler.config, **overrides)

    @classmethod
    def build(cls, cfg: Config, device: torch.device) -> "PipelinePolicy":
        """The pipeline at ``cfg.model.pretrained`` on the CPU, its weights in the dtype meant for ``device``."""
        model = cfg.model
        check_pretrained(model)
        dtype = resolve_dtype(model.dtype, device)
        frozen = frozen_parts(cls.pipeline_cls, model.pretrained, dtype, model.vae_fp32)
        transformer = cls.transformer_cls.from_pretrained(model.pretrained, subfolder="transformer", torch_dtype=dtype)
        return cls(frozen, transformer, model, cfg.sampler.shift)

    @property
    def pipe(self):
        return self.frozen.pipe

    def _apply(self, fn, recurse: bool = True):
        """``to``/``cuda``/``cpu`` move the shared frozen parts too (instances sharing them share a device)."""
        for m in self.frozen.modules:
            m._apply(fn)
        return super()._apply(fn, recurse)

    def encode_one(self, prompt: str) -> dict[str, torch.Tensor]:
        """One prompt's embeddings, batch dimension 1, as the pipeline's own ``encode_prompt`` gives them."""
        raise NotImplementedError

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        key = (type(self).__name__, self.max_sequence_length)
        return self.frozen.encode(list(prompts), key, self.encode_one).to(self.device)

    def text_device(self) -> torch.device:
        return next(self.frozen.pipe.text_encoder.parameters()).device

    def text_dtype(self) -> torch.dtype:
        """The dtype of the text encoders, and so of the prompt embeddings."""
        return next(self.frozen.pipe.text_encoder.parameters()).dtype

    def frozen_modules(self) -> dict[str, nn.Module]:
        return {name: m for name, m in self.pipe.components.items() if isinstance(m, nn.Module)}

    def check_resolution(self, resolution: int, multiple: int) -> int:
        """The latent side length for ``resolution`` pixels, which must be a multiple of ``multiple``."""
        if resolution % multiple:
            raise ConfigError(f"model.resolution {resolution} must be a multiple of {multiple} for "
                              f"{self.pipeline_cls.__name__} (VAE downsampling x patch size)")
        return resolution // self.pipe.vae_scale_factor
