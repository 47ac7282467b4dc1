"""Export a trained policy in the forms diffusers users load (``spotlight export`` calls these).

- LoRA: ``<Pipeline>.save_lora_weights(out, transformer_lora_layers=state,
  transformer_lora_adapter_metadata=...)`` writes ``pytorch_lora_weights.safetensors``. ``state``
  is the policy's ``trainable_state()``: peft's ``get_peft_model_state_dict`` keys
  (``transformer_blocks.0.attn.to_q.lora_A.weight``, adapter name stripped), which diffusers
  prefixes with ``transformer.``; ``pipe.load_lora_weights(out)`` maps them back. The adapter's
  LoraConfig goes in the safetensors metadata: without it diffusers would infer rank from the
  shapes but take ``lora_alpha = rank`` (scale 1), not the trained alpha / rank.
- ``load_lora_weights(folder)`` without ``weight_name`` raises in offline mode (``HF_HUB_OFFLINE=1``),
  even for a local folder: there, pass ``weight_name="pytorch_lora_weights.safetensors"``.
- The file's bytes are not reproducible run to run (safetensors writes its metadata map in no fixed
  order); compare tensors and metadata, not bytes.
- Measured (tests/test_pipelines.py, fp32 CPU): the pipeline with the exported LoRA samples within
  2.1e-6 of the policy (FLUX-dev: bit-identical).
- Full fine-tune: ``transformer.save_pretrained(out / "transformer")``, loaded with
  ``<Transformer>.from_pretrained(out / "transformer")`` and passed as ``transformer=`` to the
  pipeline's ``from_pretrained(base)``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from spotlight.config import LoraSection
from spotlight.models.policy import PIPELINE_CLASSES, DiffusionPolicy, policy_class


def pipeline_class(kind: str) -> type:
    """The diffusers pipeline class of ``model.kind`` (sd3, flux, qwen-image)."""
    if kind not in PIPELINE_CLASSES:
        raise ValueError(f"model.kind {kind!r} has no diffusers pipeline to export to; "
                         f"pipeline kinds: {', '.join(PIPELINE_CLASSES)}")
    return policy_class(kind).pipeline_cls


def lora_metadata(lora: LoraSection) -> dict:
    """The peft LoraConfig of an adapter trained with ``lora``, as diffusers stores it."""
    from peft import LoraConfig

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        init_lora_weights="gaussian", target_modules=list(lora.target_modules)).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}


def export_lora(policy_or_kind: DiffusionPolicy | str, state: dict[str, torch.Tensor], out_dir: str | Path,
                lora: LoraSection | None = None) -> Path:
    """Write ``state`` (an adapter's ``trainable_state``) as a diffusers LoRA in ``out_dir``.

    Give a LoRA policy, or its ``model.kind`` and ``model.lora`` (the export command has the run's
    config, not a loaded policy)."""
    if isinstance(policy_or_kind, str):
        pipe_cls = pipeline_class(policy_or_kind)
    else:
        pipe_cls, lora = type(policy_or_kind).pipeline_cls, lora or policy_or_kind.lora
    if lora is None:
        raise ValueError("exporting a LoRA needs its config (model.lora: rank, alpha, target modules)")
    out = Path(out_dir)
    layers = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    pipe_cls.save_lora_weights(out, transformer_lora_layers=layers,
                               transformer_lora_adapter_metadata=lora_metadata(lora))
    return out


def export_full(transformer: nn.Module, out_dir: str | Path) -> Path:
    """Save a fully fine-tuned transformer as ``out_dir/transformer`` (diffusers format)."""
    out = Path(out_dir) / "transformer"
    getattr(transformer, "module", transformer).save_pretrained(out)
    return out
