"""Counting memory: bytes of tensors and modules, the live-bytes peak of a computation, what a process holds.

A leaf (torch only), as torchtune keeps ``torchtune/training/memory.py``; the memory plan
(:mod:`spotlight.memory_plan`), ``bench/real_scale.py`` and the tests use it.

- :func:`bytes_by_dtype`: parameters and buffers of modules, each storage once (tied weights, views).
- :class:`LiveBytes`: a dispatch mode that books every storage an op allocates and frees it when its last
  tensor dies (a weak reference on the storage, as ``torch.distributed._tools.mem_tracker`` does), so its
  peak is what an allocator with no cache would see. Run under ``FakeTensorMode`` it counts a real-size
  forward and backward exactly with no memory and no weights: shapes, dtypes, which op saves what for
  backward and when autograd frees it all come from torch itself. What it cannot see: allocator caching
  and fragmentation, CUDA's context, kernels' private workspaces (cuBLAS, flash attention's scratch).
- :func:`profiled_peak`: the CPU allocator's own peak, from ``torch.profiler``'s memory events.
- :func:`resident_bytes`: what every module and optimizer alive in this process holds, found through the
  garbage collector: the measurement the one-policy-per-process test makes in a real trainer.
"""

from __future__ import annotations

import gc
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

GIB = 1024**3
#: the CUDA caching allocator hands out blocks in multiples of 512 bytes
CUDA_BLOCK_BYTES = 512


def gib(n: float) -> str:
    """Bytes as GiB with two decimals (what the plan prints)."""
    return f"{n / GIB:.2f}"


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    """One key per storage: its address for real tensors; meta and fake tensors have none, so the
    tensor itself (a parameter is its own storage; tied weights are one Parameter)."""
    ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
    return (str(t.device), ptr) if ptr else ("id", id(t))


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (views and tied tensors share one)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        key = _storage_key(t)
        size = t.untyped_storage().nbytes() if key[0] != "id" else t.numel() * t.element_size()
        seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values())


def bytes_by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, int]:
    """Bytes of ``tensors`` by dtype, each storage once (meta tensors count their shape x element size:
    what loading the weights would allocate)."""
    by_key: dict[tuple[str, int], torch.Tensor] = {}
    for t in tensors:
        by_key.setdefault(_storage_key(t), t)
    out: dict[torch.dtype, int] = defaultdict(int)
    for t in by_key.values():
        out[t.dtype] += tensor_bytes([t])
    return dict(out)


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers."""
    return [*module.parameters(), *module.buffers()]


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops allocate and that are still alive, and their peak.

    Every storage an op returns that none of its inputs has (views and in-place results allocate nothing)
    and that was not booked yet is booked (rounded up to ``round_to`` bytes:
    :data:`CUDA_BLOCK_BYTES` to count as the CUDA allocator does) and unbooked when Python frees it.
    Storages that existed before the mode was entered (weights, inputs) are not counted. ``mark(name)``
    records the live bytes at a point (e.g. the end of a forward: what autograd keeps for backward).
    """

    def __init__(self, round_to: int = 1):
        super().__init__()
        self.round_to = round_to
        self.live = 0
        self.peak = 0
        self.marks: dict[str, int] = {}
        self._booked: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def _book(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage in self._booked:
            return
        size = -(-storage.nbytes() // self.round_to) * self.round_to
        self._booked[storage] = size
        weakref.finalize(storage, self._free, size)
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, size: int) -> None:
        self.live -= size

    def mark(self, name: str) -> int:
        self.marks[name] = self.live
        return self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # an output that shares an input's storage (a view, an in-place op) allocated nothing
        inputs = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.device.type != "meta" and t.untyped_storage()._cdata not in inputs:
                self._book(t)
        return out


def _tensors(tree: Any) -> Iterator[torch.Tensor]:
    """The tensors in an op's arguments or results (tensors, or lists, tuples and dicts of them)."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            yield from _tensors(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from _tensors(item)


def profiled_peak(prof: Any) -> int:
    """The peak of the bytes the CPU allocator reported to a ``torch.profiler.profile(profile_memory=True)``
    above where it started: its own record of every allocation and free, in time order (the measurement the
    plan's count is checked against; it shares nothing with :class:`LiveBytes`)."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


# -- what a process holds ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Resident:
    """Bytes every module and optimizer alive in this process holds (each storage once)."""

    parameters: int  # parameters and buffers of every live nn.Module
    gradients: int  # .grad of those parameters
    optimizer_state: int  # every tensor in a live optimizer's state (AdamW: exp_avg, exp_avg_sq, step)
    modules: dict[str, int]  # how many live modules of each class (e.g. how many transformers)


def resident_bytes() -> Resident:
    """Walk the garbage collector's objects: every ``nn.Module`` and ``torch.optim.Optimizer`` alive."""
    gc.collect()
    modules = [o for o in gc.get_objects() if isinstance(o, nn.Module)]
    optimizers = [o for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer)]
    tensors = {_storage_key(t): t for m in modules for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))}
    grads = [p.grad for m in modules for p in m.parameters(recurse=False) if p.grad is not None]
    state = [v for opt in optimizers for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    counts: dict[str, int] = defaultdict(int)
    for m in modules:
        counts[type(m).__name__] += 1
    return Resident(tensor_bytes(tensors.values()), tensor_bytes(grads), tensor_bytes(state), dict(counts))
