"""Reward scoring on interchangeable runtimes, picked by measurement (issue 6).

Why: reward scoring blocks every policy update, and the fastest runtime depends on device and
batch shape (arXiv 2607.19712), so it is measured, never assumed. Every runtime is fed fixed
batch buckets (so compiled code never recompiles per shape) and must match eager within a
tolerance on a seeded batch before it is used.

Parity criterion: max|out - eager| / max(1, max|eager|). For outputs bounded by 1 (softmax
probabilities, the usual reward-model output) this is the absolute error; for raw logits it
becomes a relative error, because fp32 kernels that reorder sums differ by ~1e-6 relative.

`report` of an `auto` scorer:
    {"choice": str, "batch_size": int, "from_cache": bool, "cache_dir": str | None,
     "key": {...}, "runtimes": {name: {"median_ms", "p95_ms", "repeats", "build_s",
     "parity_error"} or {"refused": reason}}}
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import statistics
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import torch

RUNTIMES = (
    "eager",
    "compile",
    "compile-max-autotune",
    "compile-reduce-overhead",
    "onnxruntime",
    "onnxruntime-cuda",
    "aoti",
)
AUTO = "auto"
# Runtimes `auto` measures; a module attribute so tests can narrow it to deterministic choices.
AUTO_CANDIDATES: tuple[str, ...] = RUNTIMES
_ARTIFACT_SUFFIX = {"onnxruntime": ".onnx", "onnxruntime-cuda": ".onnx", "aoti": ".pt2"}
_PARITY_SEED = 1234


class RuntimeRefused(ValueError):
    """A runtime failed parity with eager, or cannot run on this device."""


BatchFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class _Ctx:
    """Everything a runtime builder needs; `sample` has batch 2 so export keeps batch dynamic."""

    model: torch.nn.Module
    item_shape: tuple[int, ...]
    device: torch.device
    buckets: tuple[int, ...]
    sample: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.sample = seeded_batch(2, self.item_shape).to(self.device)

    def batch_dim(self) -> dict[int, torch.export.Dim]:
        return {0: torch.export.Dim("batch", min=1, max=max(self.buckets))}


def seeded_batch(n: int, item_shape: tuple[int, ...], seed: int = _PARITY_SEED) -> torch.Tensor:
    """Fixed inputs in [-1, 1] (the image range of the pipeline) for parity and timing."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand((n, *item_shape), generator=g) * 2 - 1


# ---------------------------------------------------------------- runtime builders
# A builder returns the per-bucket function; `artifact` is a cached compiled file to load
# instead of exporting, `workdir` is where a fresh artifact is written (None for the runtimes that
# write none: eager and torch.compile, so a killed process leaves no folder behind).


def _build_eager(ctx: _Ctx, workdir: Path | None, artifact: Path | None) -> BatchFn:
    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return ctx.model(x)

    return run


def _compile_builder(mode: str) -> Callable[[_Ctx, Path | None, Path | None], BatchFn]:
    def build(ctx: _Ctx, workdir: Path | None, artifact: Path | None) -> BatchFn:
        # Every (model instance, bucket, mode) adds a dynamo cache entry on the same forward code
        # object; the default limit (8) would silently fall back to eager after two compiled modes.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # freezing: weights become constants (folded, prepacked for oneDNN) since we never train here.
        options = {**torch._inductor.list_mode_options(mode), "freezing": True}
        compiled = torch.compile(ctx.model, options=options, dynamic=False)

        def run(x: torch.Tensor) -> torch.Tensor:
            with torch.inference_mode():
                return compiled(x)

        return run

    return build


def _onnx_builder(provider: str) -> Callable[[_Ctx, Path, Path | None], BatchFn]:
    def build(ctx: _Ctx, workdir: Path, artifact: Path | None) -> BatchFn:
        import onnxruntime as ort

        path = artifact or workdir / "model.onnx"
        if artifact is None:
            # external_data=False: one self-contained file is the cacheable artifact (<2 GB models).
            torch.onnx.export(
                ctx.model, (ctx.sample,), str(path), dynamo=True, external_data=False, verbose=False,
                input_names=["images"], output_names=["scores"], dynamic_shapes=(ctx.batch_dim(),),
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = torch.get_num_threads()  # same threads as eager: a fair race
        session = ort.InferenceSession(str(path), options, providers=[provider])
        if session.get_providers()[0] != provider:
            raise RuntimeRefused(f"onnxruntime fell back to {session.get_providers()} instead of {provider}")

        def run(x: torch.Tensor) -> torch.Tensor:
            return torch.from_numpy(session.run(None, {"images": x.detach().cpu().contiguous().numpy()})[0])

        return run

    return build


def _build_aoti(ctx: _Ctx, workdir: Path, artifact: Path | None) -> BatchFn:
    path = artifact or workdir / "model.pt2"
    if artifact is None:
        with torch.no_grad():
            program = torch.export.export(ctx.model, (ctx.sample,), dynamic_shapes=(ctx.batch_dim(),))
        torch._inductor.aoti_compile_and_package(program, package_path=str(path), inductor_configs={"freezing": True})
    runner = torch._inductor.aoti_load_package(str(path))

    def run(x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return runner(x)

    return run


_BUILDERS: dict[str, Callable[[_Ctx, Path | None, Path | None], BatchFn]] = {
    "eager": _build_eager,
    "compile": _compile_builder("default"),
    "compile-max-autotune": _compile_builder("max-autotune-no-cudagraphs"),
    "compile-reduce-overhead": _compile_builder("reduce-overhead"),
    "onnxruntime": _onnx_builder("CPUExecutionProvider"),
    "onnxruntime-cuda": _onnx_builder("CUDAExecutionProvider"),
    "aoti": _build_aoti,
}


def unavailable_reason(runtime: str, device: str | torch.device) -> str | None:
    """Why `runtime` cannot run on `device` here, or None when it can."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "device is cuda but torch sees no CUDA device"
    if dev.type not in ("cpu", "cuda"):
        return f"device type {dev.type!r} is not supported by the reward scorer"
    if runtime == "compile-reduce-overhead" and dev.type != "cuda":
        return "reduce-overhead relies on CUDA graphs; device is cpu"
    if runtime == "onnxruntime" and dev.type != "cpu":
        return "CPUExecutionProvider would score off-device; use onnxruntime-cuda on cuda"
    if runtime == "onnxruntime-cuda":
        import onnxruntime as ort

        if dev.type != "cuda":
            return "CUDAExecutionProvider needs device cuda; device is cpu"
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return f"onnxruntime {ort.__version__} has no CUDAExecutionProvider ({ort.get_available_providers()})"
    if runtime.startswith("compile") or runtime == "aoti":
        if dev.type == "cpu" and not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
            return "inductor needs a C++ compiler on cpu and none is on PATH"
    return None


# ---------------------------------------------------------------- scorer


class Scorer:
    """Scores any batch size by padding to the next bucket and splitting beyond the largest."""

    def __init__(self, fn: BatchFn, runtime: str, ctx: _Ctx, workdir: tempfile.TemporaryDirectory | None) -> None:
        self.runtime = runtime
        self.report: dict = {}  # filled by auto
        # Batch sizes actually fed to the runtime: always buckets, so compiled code never sees new shapes.
        self.bucket_calls: Counter[int] = Counter()
        self._fn = fn
        self._ctx = ctx
        self._workdir = workdir  # keeps the loaded artifact alive as long as the scorer

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        item_shape, buckets = self._ctx.item_shape, self._ctx.buckets
        if images.ndim != len(item_shape) + 1 or tuple(images.shape[1:]) != item_shape or images.shape[0] < 1:
            raise ValueError(f"expected images [B>=1, {', '.join(map(str, item_shape))}], got {list(images.shape)}")
        images = images.to(self._ctx.device, torch.float32)
        outs = []
        for chunk in images.split(buckets[-1]):
            n = chunk.shape[0]
            bucket = next(b for b in buckets if b >= n)
            if bucket > n:
                chunk = torch.cat([chunk, chunk.new_zeros((bucket - n, *item_shape))])
            self.bucket_calls[bucket] += 1
            outs.append(self._fn(chunk)[:n].float().cpu())  # padding rows dropped
        return torch.cat(outs)

    @property
    def artifact(self) -> Path | None:
        """The compiled file this scorer runs (.onnx / .pt2), if any."""
        suffix = _ARTIFACT_SUFFIX.get(self.runtime)
        return next(Path(self._workdir.name).glob(f"*{suffix}"), None) if self._workdir else None


def parity_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max(1, max|ref|): absolute for probabilities, relative for large logits."""
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1.0)).item()


def _build(ctx: _Ctx, runtime: str, parity: tuple[torch.Tensor, torch.Tensor], tolerance: float,
           artifact: Path | None = None) -> tuple[Scorer, float, float]:
    """Build + parity-check one runtime -> (scorer, build seconds, parity error); raises RuntimeRefused."""
    reason = unavailable_reason(runtime, ctx.device)
    if reason:
        raise RuntimeRefused(f"runtime {runtime!r} is unavailable: {reason}")
    workdir = tempfile.TemporaryDirectory(prefix=f"spotlight-{runtime}-") if runtime in _ARTIFACT_SUFFIX else None
    local = None
    if artifact is not None:
        local = Path(workdir.name) / artifact.name
        shutil.copyfile(artifact, local)
    start = time.perf_counter()
    try:
        fn = _BUILDERS[runtime](ctx, Path(workdir.name) if workdir else None, local)
        scorer = Scorer(fn, runtime, ctx, workdir)
        images, ref = parity
        out = scorer(images)  # also compiles the parity batch's bucket, part of the build cost
    except RuntimeRefused:
        raise
    except Exception as e:  # export / compiler failures: refuse with the cause, keep the traceback chained
        raise RuntimeRefused(f"runtime {runtime!r} failed to build: {type(e).__name__}: {e}") from e
    build_s = time.perf_counter() - start
    err = parity_error(out, ref)
    if not err <= tolerance:  # also catches NaN
        raise RuntimeRefused(
            f"runtime {runtime!r} refused: parity error {err:.3g} vs eager exceeds tolerance {tolerance:g}"
        )
    return scorer, build_s, err


def measure_interleaved(fns: dict[str, Callable[[torch.Tensor], torch.Tensor]], images: torch.Tensor, *,
                        warmup: int = 1, min_repeats: int = 3, max_repeats: int = 20,
                        budget_s: float = 2.0) -> dict[str, list[float]]:
    """Fresh repeated timings in seconds, round-robin across runtimes.

    Why round-robin: on a shared machine the load drifts over minutes; timing each runtime once
    per round exposes all of them to the same drift instead of biasing whichever ran last.
    Runs at least min_repeats rounds, more while the slowest runtime has used under budget_s.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn(images)
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 0
    while rounds < min_repeats or (rounds < max_repeats and max(map(sum, times.values())) < budget_s):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn(images)  # Scorer returns CPU tensors, which synchronises CUDA
            times[name].append(time.perf_counter() - start)
        rounds += 1
    return times


def latency_stats(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median_ms": statistics.median(times) * 1e3, "p95_ms": p95 * 1e3, "repeats": len(times)}


# ---------------------------------------------------------------- auto + cache


def state_dict_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _cache_key(ctx: _Ctx, model_name: str, batch_size: int, tolerance: float) -> dict:
    import onnxruntime as ort

    dev = ctx.device
    device_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    return {
        "model": model_name, "state_dict_sha256": state_dict_sha256(ctx.model), "device": str(dev),
        "device_name": device_name, "threads": torch.get_num_threads(), "batch_size": batch_size,
        "item_shape": list(ctx.item_shape), "buckets": list(ctx.buckets), "tolerance": tolerance,
        "torch": torch.__version__, "onnxruntime": ort.__version__,
    }


def _load_cached(ctx: _Ctx, cache_dir: str, parity: tuple[torch.Tensor, torch.Tensor],
                 tolerance: float) -> Scorer | None:
    """Rebuild the cached choice from its artifact without measuring; None if absent or corrupt."""
    fs, root = fsspec.core.url_to_fs(cache_dir)
    if not fs.exists(f"{root}/choice.json"):
        return None
    with fs.open(f"{root}/choice.json", "rb") as f:
        choice = json.load(f)
    artifact = None
    with tempfile.TemporaryDirectory() as tmp:
        if choice["artifact"]:
            artifact = Path(tmp) / choice["artifact"]
            fs.get(f"{root}/{choice['artifact']}", str(artifact))
        try:
            scorer, _, err = _build(ctx, choice["runtime"], parity, tolerance, artifact)
        except RuntimeRefused as e:  # a corrupt artifact is re-measured, never used
            warnings.warn(f"cached reward runtime in {cache_dir} rejected, re-measuring: {e}", stacklevel=3)
            return None
    scorer.report = {**choice["report"], "from_cache": True, "cache_parity_error": err}
    return scorer


def _save_cached(cache_dir: str, scorer: Scorer, key: dict) -> None:
    """Artifact first, choice.json last: the JSON is the commit point readers look for."""
    fs, root = fsspec.core.url_to_fs(cache_dir)
    fs.makedirs(root, exist_ok=True)
    artifact = scorer.artifact
    if artifact is not None:
        with open(artifact, "rb") as src, fs.open(f"{root}/{artifact.name}", "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 << 20)
    choice = {"runtime": scorer.runtime, "artifact": artifact.name if artifact else None, "key": key,
              "report": scorer.report}
    with fs.open(f"{root}/choice.json", "wb") as f:
        f.write(json.dumps(choice, indent=2).encode())


def _auto(ctx: _Ctx, batch_size: int, cache_url: str | None, model_name: str, tolerance: float,
          parity: tuple[torch.Tensor, torch.Tensor]) -> Scorer:
    key = _cache_key(ctx, model_name, batch_size, tolerance)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = f"{cache_url.rstrip('/')}/{model_name}-{digest}" if cache_url else None
    if cache_dir and (cached := _load_cached(ctx, cache_dir, parity, tolerance)):
        return cached
    results: dict[str, dict] = {}
    built: dict[str, Scorer] = {}
    for runtime in AUTO_CANDIDATES:
        try:
            built[runtime], build_s, err = _build(ctx, runtime, parity, tolerance)
        except RuntimeRefused as e:
            results[runtime] = {"refused": str(e)}
            continue
        results[runtime] = {"build_s": build_s, "parity_error": err}
    if not built:
        raise RuntimeRefused(f"auto: no runtime passed on {ctx.device}: {results}")
    for runtime, times in measure_interleaved(built, parity[0]).items():
        results[runtime].update(latency_stats(times))
    scorer = built[min(built, key=lambda r: results[r]["median_ms"])]
    scorer.report = {"choice": scorer.runtime, "batch_size": batch_size, "from_cache": False,
                     "cache_dir": cache_dir, "key": key, "runtimes": results}
    if cache_dir:
        _save_cached(cache_dir, scorer, key)
    return scorer


def make_scorer(model: torch.nn.Module, item_shape: tuple[int, ...], *, runtime: str = "eager",
                batch_size: int = 32, device: str = "cpu", cache_url: str | None = None,
                model_name: str = "model", buckets: tuple[int, ...] = (1, 8, 32, 128),
                tolerance: float = 1e-5) -> Scorer:
    """Scorer for `model` on `runtime` ("auto" measures and caches the fastest passing one).

    The model is moved to `device` in place and must map [B, *item_shape] float32 -> [B, ...].
    An explicit runtime that fails parity or is unavailable raises RuntimeRefused.
    """
    if runtime != AUTO and runtime not in RUNTIMES:
        raise ValueError(f"unknown runtime {runtime!r}; valid: {', '.join((AUTO, *RUNTIMES))}")
    if batch_size < 1 or not buckets or min(buckets) < 1:
        raise ValueError(f"batch_size and buckets must be >= 1, got {batch_size}, {buckets}")
    ctx = _Ctx(model.to(device).eval(), tuple(item_shape), torch.device(device), tuple(sorted(set(buckets))))
    images = seeded_batch(batch_size, ctx.item_shape)
    with torch.inference_mode():
        ref = ctx.model(images.to(ctx.device)).float().cpu()
    parity = (images, ref)
    if runtime == AUTO:
        return _auto(ctx, batch_size, cache_url, model_name, tolerance, parity)
    return _build(ctx, runtime, parity, tolerance)[0]
