"""The policy seam: everything the RL code needs from a diffusion policy, and nothing more.

The sampler, GRPO, exploration, evaluation and the run store only see :class:`Policy`: encode
prompts (and the null prompt for CFG), predict the rectified-flow velocity ``v = noise - x0`` at
noise level sigma, decode latents into images, the scheduler's sigma schedule, the trainable
parameters and their state, a reference context for the KL term, and the module to wrap for data
parallel. Implementations: the tiny digits MMDiT (:mod:`spotlight.models.tiny`, the embedded
default) and diffusers pipelines loaded with ``from_pretrained`` (:mod:`spotlight.models.sd3`,
``flux``, ``qwen_image``); ``model.kind`` picks one from :data:`POLICIES`.

:class:`DiffusionPolicy` holds what every implementation shares: LoRA (peft, as flow_grpo and
diffusers' training scripts do) or full fine-tuning, the trainable state, the reference context
(LoRA: the same module with its adapters disabled, no second copy), precision (bf16 weights and
autocast on CUDA; velocities, SDE log-probs and the loss stay fp32) and classifier-free guidance.
"""

from __future__ import annotations

import copy
import importlib
import json
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ContextManager, Iterator, Protocol, Sequence

import torch
from torch import nn

from spotlight.config import ConfigError, LoraSection, ModelSection


@dataclass
class PromptEmbeds:
    """Text conditioning of a batch of prompts: named tensors, each batch-first (SD3: tokens and a pooled
    vector; FLUX: T5 tokens and a pooled CLIP vector; Qwen-Image: tokens and their mask)."""

    tensors: dict[str, torch.Tensor]

    def __getitem__(self, idx) -> "PromptEmbeds":
        return PromptEmbeds({k: v[idx] for k, v in self.tensors.items()})

    def __len__(self) -> int:
        return len(next(iter(self.tensors.values())))

    def to(self, device: torch.device | str) -> "PromptEmbeds":
        return PromptEmbeds({k: v.to(device) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: Sequence["PromptEmbeds"]) -> "PromptEmbeds":
        return PromptEmbeds({k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors})


class Policy(Protocol):
    """What the RL code calls. Latents have ``latent_shape`` per sample (unpacked, ``[C, h, w]``)."""

    latent_shape: tuple[int, ...]
    device: torch.device  # where latents live; rollout noise is drawn on the CPU and moved here
    transformer: nn.Module  # the trained module: what data parallel wraps

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds: ...

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, prompt: PromptEmbeds,
                 guidance: float = 1.0) -> torch.Tensor: ...

    def guided_velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds,
                        uncond: PromptEmbeds | None, guidance: float) -> torch.Tensor: ...

    def needs_uncond(self, guidance: float) -> bool: ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor: ...

    def sigmas(self, steps: int) -> torch.Tensor: ...

    def trainable_parameters(self) -> list[nn.Parameter]: ...

    def trainable_state(self) -> dict[str, torch.Tensor]: ...

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None: ...

    def reference(self) -> ContextManager["Policy"]: ...


class DiffusionPolicy(nn.Module):
    """Shared machinery of the policies; subclasses set ``transformer`` and ``latent_shape`` and
    implement ``encode_prompts``, ``velocity`` (fp32 out), ``decode`` and ``sigmas``."""

    transformer: nn.Module
    latent_shape: tuple[int, ...]
    #: the transformer takes the guidance scale as an input (FLUX.1-dev's distilled guidance):
    #: one pass per step instead of a conditional and an unconditional one
    embedded_guidance: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.lora: LoraSection | None = None
        self._reference: nn.Module | None = None
        self.compute_dtype = torch.float32

    # -- what the memory plan reads ----------------------------------------------------------------
    def frozen_modules(self) -> dict[str, nn.Module]:
        """The frozen modules beside the transformer (text encoders, VAE), by name."""
        return {}

    def prompt_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per prompt, the shape (no batch dimension) and dtype of each tensor ``encode_prompts`` returns."""
        raise NotImplementedError

    def text_lengths(self) -> dict[str, int]:
        """The tokens each text encoder of ``frozen_modules`` reads per prompt."""
        return {}

    # -- device and precision --------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def autocast(self) -> ContextManager:
        """bf16 autocast where the weights are bf16 (CUDA); a no-op in fp32."""
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    # -- guidance ----------------------------------------------------------------------------------
    def needs_uncond(self, guidance: float) -> bool:
        """Whether guidance needs the null prompt's pass (true CFG) rather than none or an embedding."""
        return guidance != 1.0 and not self.embedded_guidance

    def combine_guidance(self, v_cond: torch.Tensor, v_uncond: torch.Tensor, guidance: float) -> torch.Tensor:
        """Classifier-free guidance (SD3's form); Qwen-Image overrides it with its norm-preserving form."""
        return v_uncond + guidance * (v_cond - v_uncond)

    def guided_velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds,
                        uncond: PromptEmbeds | None, guidance: float) -> torch.Tensor:
        """The velocity a guided sampler steps with; the conditional and unconditional passes share
        one batch (sigma is per row, or one value for all)."""
        if not self.needs_uncond(guidance):
            return self.velocity(latents, sigma, cond, guidance)
        if uncond is None:
            raise ValueError(f"guidance {guidance} needs the null prompt's embeddings (uncond)")
        sigma = sigma.expand(len(latents)) if sigma.ndim == 0 else sigma
        v = self.velocity(torch.cat([latents, latents]), torch.cat([sigma, sigma]), PromptEmbeds.cat([cond, uncond]))
        v_cond, v_uncond = v.chunk(2)
        return self.combine_guidance(v_cond, v_uncond, guidance)

    # -- training ----------------------------------------------------------------------------------
    @property
    def core(self) -> nn.Module:
        """The transformer itself, also when data parallel has wrapped ``transformer``."""
        return getattr(self.transformer, "module", self.transformer)

    def add_lora(self, lora: LoraSection, seed: int) -> None:
        """Attach a LoRA adapter (peft) to the transformer; its initial weights follow ``seed``, and its
        B matrices start at zero, so theta_0 samples exactly as the base does."""
        from peft import LoraConfig

        missing = missing_lora_targets(self.core, lora.target_modules)
        if missing:
            raise ValueError(f"model.lora.target_modules: {missing} match no module of the "
                             f"{type(self.core).__name__}")
        self.core.requires_grad_(False)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.core.add_adapter(LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                             init_lora_weights="gaussian", target_modules=list(lora.target_modules)))
        for p in self.trainable_parameters():  # the adapter trains in fp32 whatever the base's dtype
            p.data = p.data.float()
        self.lora = lora

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.core.parameters() if p.requires_grad]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """What RL changes: the adapter's tensors with LoRA (never the base), else the transformer's."""
        if self.lora is not None:
            from peft.utils import get_peft_model_state_dict

            return get_peft_model_state_dict(self.core)
        return dict(self.core.state_dict())

    def load_trainable_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.lora is not None:
            from peft.utils import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.core, state)
            unexpected = getattr(result, "unexpected_keys", [])
            if unexpected:
                raise ValueError(f"adapter state has keys this model's adapter lacks: {unexpected[:3]}")
        else:
            current = self.core.state_dict()
            self.core.load_state_dict({k: v.to(current[k].dtype) for k, v in state.items()}, strict=True)

    @property
    def has_reference(self) -> bool:
        """Whether :meth:`reference` can run: LoRA always; full fine-tuning after :meth:`keep_reference`."""
        return self.lora is not None or self._reference is not None

    def keep_reference(self) -> dict[str, torch.Tensor]:
        """Full fine-tuning: freeze a copy of the current weights as the KL reference (LoRA needs none);
        returns the reference's state (its own tensors, not another copy)."""
        if self.lora is None and self._reference is None:
            self._reference = copy.deepcopy(self.core).requires_grad_(False).eval()
        return {} if self._reference is None else dict(self._reference.state_dict())

    @contextmanager
    def reference(self) -> Iterator["DiffusionPolicy"]:
        """The KL reference policy: with LoRA the same module with its adapters disabled; with full
        fine-tuning the copy made by :meth:`keep_reference`, swapped in for the duration."""
        if self.lora is not None:
            self.core.disable_adapters()
            try:
                yield self
            finally:
                self.core.enable_adapters()
            return
        if self._reference is None:
            raise RuntimeError("full fine-tuning needs keep_reference() before the KL term can be computed")
        trained, self.transformer = self.transformer, self._reference
        try:
            yield self
        finally:
            self.transformer = trained


def missing_lora_targets(module: nn.Module, targets: Sequence[str]) -> list[str]:
    """Target names (peft's suffix match on module names) that no module of ``module`` has."""
    names = [name for name, _ in module.named_modules()]
    return [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in names)]


#: model.kind -> "module:class"; each class has ``build(cfg: Config, device) -> DiffusionPolicy``, which
#: returns the policy on the CPU in the dtype meant for ``device`` (build_policy moves it)
POLICIES: dict[str, str] = {
    "tiny-mmdit": "spotlight.models.tiny:TinyMMDiT",
    "sd3": "spotlight.models.sd3:SD3Policy",
    "flux": "spotlight.models.flux:FluxPolicy",
    "qwen-image": "spotlight.models.qwen_image:QwenImagePolicy",
}


def policy_class(kind: str) -> type[DiffusionPolicy]:
    module, _, name = POLICIES[kind].partition(":")
    return getattr(importlib.import_module(module), name)


#: model.kind -> the diffusers pipeline class its ``model.pretrained`` folder must hold
PIPELINE_CLASSES: dict[str, str] = {
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "qwen-image": "QwenImagePipeline",
}


def check_pretrained(model: ModelSection) -> dict | None:
    """Fail before any compute if ``model.pretrained`` is not a diffusers folder of the pipeline
    ``model.kind`` expects (reads model_index.json only); returns that index (None for tiny-mmdit)."""
    expected = PIPELINE_CLASSES.get(model.kind)
    if expected is None:
        return None
    root = Path(model.pretrained)
    what = f"a diffusers {expected} folder (what save_pretrained writes)"
    if not root.is_dir():
        raise ConfigError(f"model.pretrained: {root} {'is not a folder' if root.exists() else 'does not exist'}; "
                          f"expected {what}")
    index_file = root / "model_index.json"
    if not index_file.is_file():
        raise ConfigError(f"model.pretrained: {root} has no model_index.json; expected {what}")
    try:
        index = json.loads(index_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"model.pretrained: {index_file} is not valid JSON ({e})") from None
    found = index.get("_class_name")
    if found != expected:
        raise ConfigError(f"model.pretrained: {root} is a {found}, model.kind {model.kind} expects {expected}")
    missing = [name for name, spec in index.items()
               if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None
               and not (root / name).is_dir()]
    if missing:
        raise ConfigError(f"model.pretrained: {root} lacks the component folder(s) {missing} that its "
                          "model_index.json lists")
    return index


def lora_target_check(model: ModelSection) -> None:
    """Fail before loading any weights if a ``model.lora.target_modules`` entry matches no module of the
    pipeline's transformer: the transformer is built from its config.json on the meta device."""
    if model.lora is None or model.kind not in PIPELINE_CLASSES:
        return  # the tiny model is built in full anyway; add_lora checks it
    from accelerate import init_empty_weights

    library, class_name = check_pretrained(model)["transformer"]
    transformer_cls = getattr(importlib.import_module(library), class_name)
    folder = Path(model.pretrained) / "transformer"
    with init_empty_weights():
        transformer = transformer_cls.from_config(transformer_cls.load_config(folder))
    missing = missing_lora_targets(transformer, model.lora.target_modules)
    if missing:
        raise ConfigError(f"model.lora.target_modules: {missing} match no module of the {class_name} in {folder}")


def build_policy(cfg, device: torch.device | str = "cpu",
                 base_state: dict[str, torch.Tensor] | None = None) -> DiffusionPolicy:
    """The configured policy at theta_0 on ``device``: the base weights (``base_state`` replaces the
    transformer's: the tiny model's pretrained base), then the LoRA adapter if configured.

    ``cfg`` is the whole run config: the tiny model's schedule follows ``sampler.shift``. ``build``
    returns the policy on the CPU (weights in the dtype meant for ``device``) and it moves to
    ``device`` only after the LoRA adapter is attached: the adapter's initial weights are drawn by
    the CPU generator, so they are the same on every machine."""
    model: ModelSection = cfg.model
    device = torch.device(device)
    check_pretrained(model)
    lora_target_check(model)
    policy = policy_class(model.kind).build(cfg, device)
    if base_state is not None:
        policy.core.load_state_dict(base_state, strict=True)
    if model.lora is not None:
        policy.add_lora(model.lora, seed=cfg.run.seed)
    if model.gradient_checkpointing and hasattr(policy.core, "enable_gradient_checkpointing"):
        policy.core.enable_gradient_checkpointing()
    return policy.to(device)
