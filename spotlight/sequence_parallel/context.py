"""Diffusers' context parallelism on a policy's transformer, switched on and off per group generation.

diffusers 0.39 ships the sequence split itself (``ContextParallelConfig``, the ``_cp_plan`` of
``FluxTransformer2DModel`` and ``QwenImageTransformer2DModel``, hooks that shard the inputs along the
sequence and all-gather ``proj_out``'s output); nothing here splits attention by hand. What it lacks
is a way back: ``enable_parallelism`` has no inverse, and an elastic group changes its degree, so
:func:`disable` removes the hooks with diffusers' own ``remove_context_parallel`` and clears the
processors' parallel config.

What runs where (measured on this machine's torch 2.13 CPU build, gloo; see docs/sequence_parallel.md):

- **Ulysses** on the CPU with gloo: runs (gloo has ``all_to_all_single`` in torch 2.13; the
  ``native`` SDPA backend supports context parallelism).
- **Ring** on the CPU: does not run. Ring attention merges partial results with their log-sum-exp,
  and ``native`` (the only context-parallel backend that runs on a CPU) raises ``ValueError: Native
  attention does not support return_lse=True`` inside ``TemplatedRingAttention.forward``; the
  backends that return it (``_native_cudnn``, ``_native_flash``, ``flash``, ``sage``...) need CUDA.
  :func:`check_mode` fails early with that explanation instead of on the first forward.
"""

from __future__ import annotations

import torch
from torch import nn

from spotlight.config import ConfigError, SequenceParallelSection


def heads(policy) -> int:
    """Attention heads of the policy's transformer (Ulysses scatters them over the group)."""
    return int(policy.core.config.num_attention_heads)


def sequence_lengths(policy) -> dict[str, int]:
    """The token counts the transformer's ``_cp_plan`` splits along the sequence: image tokens (2x2
    packed latents) and text tokens (FLUX and Qwen-Image pad text to ``max_sequence_length``)."""
    _, h, w = policy.latent_shape
    return {"image tokens": (h // 2) * (w // 2), "text tokens": int(policy.max_sequence_length)}


def valid_degree(degree: int, mode: str, n_heads: int, lengths: dict[str, int]) -> bool:
    """Whether diffusers can shard these inputs over ``degree`` processes: its EquipartitionSharder
    asserts that the degree divides every split sequence, and Ulysses gives each process
    ``heads / degree`` whole heads."""
    if degree == 1:
        return True
    if any(n % degree for n in lengths.values()):
        return False
    return mode != "ulysses" or n_heads % degree == 0


def largest_valid_degree(processes: int, mode: str, n_heads: int, lengths: dict[str, int]) -> int:
    """The largest degree <= ``processes`` diffusers accepts for these inputs (1 always is)."""
    return max(d for d in range(1, processes + 1) if valid_degree(d, mode, n_heads, lengths))


def resolve_backend(sp: SequenceParallelSection, device: torch.device) -> str:
    return ("nccl" if device.type == "cuda" else "gloo") if sp.backend == "auto" else sp.backend


def attention_backend(sp: SequenceParallelSection) -> str:
    """The diffusers attention backend: ring needs one that returns the log-sum-exp."""
    return sp.attention_backend or ("_native_cudnn" if sp.mode == "ring" else "native")


def check_mode(sp: SequenceParallelSection, device: torch.device) -> None:
    """Fail before any group forms if diffusers cannot run this mode on this device."""
    if sp.mode == "ring" and device.type != "cuda" and sp.degree > 1:
        raise ConfigError(
            "sequence_parallel.mode ring does not run on the CPU with diffusers 0.39: ring attention merges "
            "partial results by their log-sum-exp, and the only context-parallel attention backend that runs on "
            "a CPU (native SDPA) raises 'Native attention does not support return_lse=True'; the backends that "
            "return it (_native_cudnn, _native_flash, flash, sage) need CUDA. Use mode ulysses on the CPU.")


def enable(transformer: nn.Module, sp: SequenceParallelSection, degree: int) -> None:
    """Shard the transformer's sequence over the current default process group (``degree`` processes)."""
    from diffusers import ContextParallelConfig

    transformer.set_attention_backend(attention_backend(sp))
    key = "ulysses_degree" if sp.mode == "ulysses" else "ring_degree"
    transformer.enable_parallelism(config=ContextParallelConfig(**{key: degree}))


def disable(transformer: nn.Module) -> None:
    """Undo :func:`enable`: the hooks off, the processors back to plain attention (diffusers has no
    ``disable_parallelism``); the module is then whole again and may be enabled at another degree."""
    from diffusers.hooks.context_parallel import remove_context_parallel

    config = getattr(transformer, "_parallel_config", None)
    if config is None:
        return
    remove_context_parallel(transformer, transformer._cp_plan)
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if getattr(processor, "_parallel_config", None) is not None:
            processor._parallel_config = None
    transformer._parallel_config = None
