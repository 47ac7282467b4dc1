"""A pipeline policy with no weights: every module built on the ``meta`` device from ``config.json`` files.

One builder, two users (as torchtune builds on ``torch.device("meta")`` before it loads or shards):

- the memory plan (:mod:`spotlight.memory_plan`) counts parameter bytes and runs the policy's own
  forward and backward on fake tensors, at real size, with no weight file on the machine;
- a sequence-parallel replacement (:mod:`spotlight.sequence_parallel.weights`) builds its skeleton here
  and receives every tensor from a peer instead of reading storage.

The folder is ``model.pretrained`` when it holds a pipeline, else the published architecture the config
names in ``model.architecture`` (``configs/architectures/<name>``: the real pipelines' ``config.json``
files, kilobytes, with their sources in that folder's README). Parameters are on ``meta``. Buffers a module
computes at construction (RoPE tables, position ids) are real for the skeleton, as accelerate's
``init_empty_weights`` leaves them, because a peer never sends them; the plan needs none of them real.
Tokenizers are built only where their files are (a pipeline folder): an architecture folder has none, and
its policy cannot encode prompts, which the plan never asks of it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from spotlight.config import Config, ConfigError, PipelineModelSection
from spotlight.models.policy import DiffusionPolicy, PIPELINE_CLASSES, check_pretrained, policy_class

#: the shipped published architectures, one diffusers-layout folder of configs each
ARCHITECTURES_DIR = Path(__file__).resolve().parent.parent.parent / "configs" / "architectures"


def architectures() -> list[str]:
    """The names ``model.architecture`` may take (folders of ``configs/architectures`` with a pipeline)."""
    return sorted(p.name for p in ARCHITECTURES_DIR.iterdir() if (p / "model_index.json").is_file())


def architecture_folder(name: str) -> Path:
    folder = ARCHITECTURES_DIR / name
    if not (folder / "model_index.json").is_file():
        raise ConfigError(f"model.architecture {name!r} is not a shipped architecture; known: {', '.join(architectures())}")
    return folder


def model_folder(model: PipelineModelSection) -> Path:
    """Where a pipeline's configs are read: ``model.pretrained`` when it holds a pipeline (the weights a
    run will load), else the published architecture ``model.architecture`` names."""
    if (Path(model.pretrained) / "model_index.json").is_file():
        check_pretrained(model)
        return Path(model.pretrained)
    if model.architecture is None:
        raise ConfigError(f"model.pretrained {model.pretrained} is not on this machine and model.architecture is "
                          f"not set: name the published architecture to plan with ({', '.join(architectures())})")
    folder = architecture_folder(model.architecture)
    found = json.loads((folder / "model_index.json").read_text())["_class_name"]
    if found != PIPELINE_CLASSES[model.kind]:
        raise ConfigError(f"model.architecture {model.architecture} is a {found}; model.kind {model.kind} expects "
                          f"{PIPELINE_CLASSES[model.kind]}")
    return folder


def component_classes(folder: Path) -> dict[str, type]:
    """The pipeline's components as ``model_index.json`` names them (None entries left out)."""
    index = json.loads((Path(folder) / "model_index.json").read_text())
    return {name: getattr(importlib.import_module(spec[0]), spec[1]) for name, spec in index.items()
            if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None}


def module_on_meta(klass: type, folder: Path, real_buffers: bool = False, dtype: torch.dtype | None = None) -> nn.Module:
    """One component built from its ``config.json`` with its parameters on ``meta``, in the dtypes
    ``from_pretrained(torch_dtype=dtype)`` gives it (None: as constructed, fp32).

    ``real_buffers``: the buffers a module computes at construction are real (accelerate's
    ``init_empty_weights``: what a skeleton that receives only the state dict needs); otherwise everything is
    on ``meta`` (``torch.device("meta")``: nothing allocated, a 12B transformer in a fraction of a second).

    Dtypes as the libraries load them: diffusers builds in fp32 and casts the module (parameters and
    floating buffers); transformers builds with ``_from_config(dtype=...)`` (``dtype`` as the default dtype, so
    buffers computed in fp32 on purpose, rotary ``inv_freq``, stay fp32) and keeps
    ``_keep_in_fp32_modules_strict`` (and, for fp16, ``_keep_in_fp32_modules``) in fp32.
    ``tests/test_memory.py`` checks both against ``from_pretrained``."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    with init_empty_weights() if real_buffers else torch.device("meta"):
        if klass.__module__.startswith("diffusers"):
            module = klass.from_config(klass.load_config(folder))
            return module if dtype is None else module.to(dtype)
        config = AutoConfig.from_pretrained(folder)
        module = klass(config) if dtype is None else klass._from_config(config, dtype=dtype)
    module.tie_weights()  # as from_pretrained ties them (T5's embed_tokens is its shared embedding)
    keep = list(getattr(module, "_keep_in_fp32_modules_strict", None) or [])
    if dtype == torch.float16:
        keep += list(getattr(module, "_keep_in_fp32_modules", None) or [])
    for name, sub in module.named_modules():
        if any(k in name.split(".") for k in keep):
            sub.to(torch.float32)
    return module


def components_on_meta(folder: Path, dtype: torch.dtype | None = None, real_buffers: bool = False) -> dict[str, Any]:
    """Every component of the pipeline in ``folder``: modules on ``meta`` (cast to ``dtype`` if given; buffers
    as :func:`module_on_meta`), the scheduler from its config, tokenizers and processors from their files
    (None where the folder has none)."""
    folder = Path(folder)
    out: dict[str, Any] = {}
    for name, klass in component_classes(folder).items():
        if issubclass(klass, nn.Module):
            out[name] = module_on_meta(klass, folder / name, real_buffers, dtype)
        elif (folder / name).is_dir():
            out[name] = klass.from_pretrained(folder / name)
        else:
            out[name] = None
    return out


def policy_on_meta(cfg: Config, folder: Path | None = None, dtype: torch.dtype | None = None,
                   real_buffers: bool = False) -> DiffusionPolicy:
    """The configured pipeline policy with its weights on ``meta``, LoRA adapter attached as
    :func:`~spotlight.models.policy.build_policy` attaches it (fp32 whatever the base's dtype).

    ``folder``: default :func:`model_folder`; ``dtype``: the base weights' dtype (None: as constructed,
    fp32; a peer's weights replace them with theirs); ``real_buffers``: see :func:`module_on_meta`."""
    from spotlight.models.pipeline_policy import FrozenParts

    if cfg.model.kind not in PIPELINE_CLASSES:
        raise ValueError("a policy on meta needs a diffusers pipeline model.kind (flux, qwen-image, sd3)")
    folder = model_folder(cfg.model) if folder is None else Path(folder)
    cls = policy_class(cfg.model.kind)
    components = components_on_meta(folder, dtype, real_buffers)
    if cfg.model.vae_fp32 and "vae" in components:  # as frozen_parts loads it: the rewards' decode in fp32
        components["vae"].to(torch.float32)
    transformer = components.pop("transformer")
    policy = cls(FrozenParts(cls.pipeline_cls(transformer=None, **components)), transformer, cfg.model, cfg.sampler.shift)
    if cfg.model.lora is not None:
        with torch.device("meta"):  # peft would allocate (and initialise) the adapter on the CPU first
            policy.add_lora(cfg.model.lora, seed=cfg.run.seed)
    return policy
