"""A policy with no weights yet, and the in-memory weight copy that fills it from a peer.

A replacement process must not reload weights from storage (minutes for a 12B model from S3): it
builds the policy's modules on the ``meta`` device from the pipeline folder's ``config.json`` files
(kilobytes; tokenizers and the scheduler config are files too, read as they are) with the builder the
memory plan shares (:mod:`spotlight.models.meta`), then receives
every tensor from a peer that holds them, over the group's process group (a broadcast: NCCL on
GPUs, gloo here). The policy's tensors are its transformer (with the LoRA adapter when configured)
and the pipeline's frozen modules (text encoders, VAE).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from spotlight.config import Config
from spotlight.models.meta import policy_on_meta
from spotlight.models.policy import DiffusionPolicy, check_pretrained


def policy_modules(policy: DiffusionPolicy) -> dict[str, nn.Module]:
    """Every module whose tensors make up the policy, by a stable name (the same on every process)."""
    frozen = {name: m for name, m in policy.pipe.components.items() if isinstance(m, nn.Module)}
    return {"transformer": policy.core, **dict(sorted(frozen.items()))}


def skeleton_policy(cfg: Config) -> DiffusionPolicy:
    """The configured pipeline policy with all its tensors on ``meta``: built from the folder's configs
    (no weight file is opened), LoRA adapter attached as :func:`build_policy` attaches it."""
    if check_pretrained(cfg.model) is None:
        raise ValueError("a skeleton needs a diffusers pipeline model.kind (flux, qwen-image, sd3)")
    return policy_on_meta(cfg, Path(cfg.model.pretrained), real_buffers=True)


def share_weights(policy: DiffusionPolicy, src: int, receivers: list[int], device: torch.device) -> int:
    """Copy every tensor of ``policy`` from rank ``src`` to the ``receivers`` over the default process
    group; every rank of the group calls this (creating the sub-group is collective). Returns the bytes
    this rank sent or received (0 outside the copy)."""
    group = dist.new_group(ranks=sorted({src, *receivers}))
    rank = dist.get_rank()
    if rank != src and rank not in receivers:
        return 0
    modules = policy_modules(policy)
    if rank == src:
        states = {name: m.state_dict() for name, m in modules.items()}
        manifest = [(name, key, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                    for name, state in states.items() for key, t in state.items()]
    else:
        manifest = None
    box = [manifest]
    dist.broadcast_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    manifest = box[0]
    received: dict[str, dict[str, torch.Tensor]] = {name: {} for name in modules}
    sent = 0
    for name, key, shape, dtype in manifest:
        if rank == src:
            tensor = states[name][key].detach().to(device).contiguous()
        else:
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        dist.broadcast(tensor, src=src, group=group)
        sent += tensor.numel() * tensor.element_size()
        received[name][key] = tensor
    if rank != src:
        for name, module in modules.items():
            module.load_state_dict(received[name], strict=True, assign=True)  # keeps requires_grad
            module.to(device)  # buffers built at construction (not in the state) follow the weights
        missing = [f"{n}.{k}" for n, m in modules.items()
                   for k, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
        if missing:
            raise RuntimeError(f"weights from rank {src} left tensors on meta: {missing[:5]}")
        # the base weights' dtype (bf16 on CUDA; a LoRA adapter stays fp32), as the policy's __init__ sets it
        policy.compute_dtype = next(t.dtype for k, t in received["transformer"].items()
                                    if "lora_" not in k and t.is_floating_point())
    dist.destroy_process_group(group)
    return sent
