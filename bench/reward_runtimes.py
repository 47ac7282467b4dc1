"""Reward-scoring runtimes side by side in one run (issue 6).

Prints p50/p95 latency, images/s and throughput ratio to eager for every runtime available on
this device at each batch size, the parity error of each against eager on the same inputs,
build (export/compile) time separately, and which runtime `auto` picks at the RL batch size.

    .venv/bin/python bench/reward_runtimes.py --model vit-b16 --batch-sizes 1,8,32,128
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from spotlight import reward_runtime as rr  # noqa: E402
from spotlight.reward_models import VIT_B16, build_vit  # noqa: E402

# vit-b16: 3 repeats took 17 min on 2 shared cores (load ~3), est. ~11 min idle; see docs/reward_runtimes.md.
DEFAULT_REPEATS = {"vit-b16": 3, "digits-cnn": 30}


def digits_cnn() -> tuple[nn.Module, tuple[int, ...]]:
    """The pipeline's digit reward classifier (random weights: speed does not depend on them)."""
    from spotlight.models.classifier import DigitClassifier

    return DigitClassifier().eval(), (1, 16, 16)


def gemm_peak_gflops(threads: int) -> float:
    """This CPU's best fp32 matmul rate at `threads` threads: median of 5 4096x4096 products."""
    with torch.inference_mode():
        a, b = torch.randn(4096, 4096), torch.randn(4096, 4096)
        a @ b
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    return 2 * 4096**3 / sorted(times)[2] / 1e9


def main(
    model: str = typer.Option("vit-b16", help="vit-b16 | digits-cnn"),
    batch_sizes: str = typer.Option("1,8,32,128", help="comma-separated; each should be a bucket"),
    repeats: int = typer.Option(0, help="timed calls per cell after one warm-up; 0 = model default"),
    rl_batch_size: int = typer.Option(32, help="batch size `auto` is measured and chosen at"),
    device: str = typer.Option("cpu"),
    cache_url: str = typer.Option("", help="auto's cache (fsspec URL); default: a fresh temp dir"),
) -> None:
    console = Console(width=140)
    if model == "vit-b16":
        net, item_shape = build_vit(VIT_B16), VIT_B16.item_shape
    elif model == "digits-cnn":
        net, item_shape = digits_cnn()
    else:
        raise typer.BadParameter(f"unknown model {model!r}; valid: vit-b16, digits-cnn")
    sizes = [int(s) for s in batch_sizes.split(",")]
    repeats = repeats or DEFAULT_REPEATS[model]
    cache_url = cache_url or f"file://{tempfile.mkdtemp(prefix='reward-rt-cache-')}"
    started = time.perf_counter()
    console.print(
        f"model={model} item_shape={item_shape} device={device} torch={torch.__version__} "
        f"threads={torch.get_num_threads()} load avg 1 min={os.getloadavg()[0]:.2f} (before start) "
        f"repeats={repeats} (+1 warm-up) per cell, batch sizes={sizes}"
    )

    inputs = {b: rr.seeded_batch(b, item_shape, seed=b) for b in sizes}
    scorers: dict[str, rr.Scorer] = {}
    builds: dict[str, str] = {}
    for runtime in rr.RUNTIMES:
        try:
            t0 = time.perf_counter()
            scorers[runtime] = rr.make_scorer(net, item_shape, runtime=runtime, batch_size=rl_batch_size,
                                              device=device)
            builds[runtime] = f"{time.perf_counter() - t0:.1f}"
        except rr.RuntimeRefused as e:
            builds[runtime] = f"refused: {e}"
    console.print(f"  built {list(scorers)} ({time.perf_counter() - started:.0f}s elapsed)")

    rows: dict[str, dict[int, dict]] = {runtime: {} for runtime in scorers}
    for b in sizes:
        ref = None
        for runtime, scorer in scorers.items():  # eager first: it is the parity reference
            t0 = time.perf_counter()
            out = scorer(inputs[b])  # the warm-up; compiles this bucket if not yet compiled
            rows[runtime][b] = {"first_s": time.perf_counter() - t0}
            ref = out if ref is None else ref
            rows[runtime][b]["parity"] = rr.parity_error(out, ref)
        timings = rr.measure_interleaved(scorers, inputs[b], warmup=0, min_repeats=repeats, max_repeats=repeats)
        for runtime, times in timings.items():
            rows[runtime][b].update(rr.latency_stats(times))
        console.print(f"  measured batch {b} ({time.perf_counter() - started:.0f}s elapsed)")
    del scorers

    table = Table(title=f"Reward scoring runtimes: {model} on {device} (median of {repeats} interleaved fresh calls)")
    for col in ("runtime", "batch", "p50 ms", "p95 ms", "img/s", "x eager", "parity err", "first call s"):
        table.add_column(col, justify="left" if col == "runtime" else "right")
    for b in sizes:
        eager_ms = rows["eager"][b]["median_ms"]
        for runtime, cells in rows.items():
            c = cells[b]
            table.add_row(runtime, str(b), f"{c['median_ms']:.1f}", f"{c['p95_ms']:.1f}",
                          f"{b * 1e3 / c['median_ms']:.1f}", f"{eager_ms / c['median_ms']:.2f}",
                          f"{c['parity']:.1e}", f"{c['first_s']:.2f}")
        table.add_section()
    console.print(table)

    if model == "vit-b16" and device == "cpu" and rl_batch_size in sizes:
        # Roofline: how far from this CPU's fp32 matmul peak eager already is.
        eager_gflops = VIT_B16.forward_flops * rl_batch_size / rows["eager"][rl_batch_size]["median_ms"] / 1e6
        best = min(rows, key=lambda r: rows[r][rl_batch_size]["median_ms"])
        best_x = rows["eager"][rl_batch_size]["median_ms"] / rows[best][rl_batch_size]["median_ms"]
        peak = gemm_peak_gflops(torch.get_num_threads())
        console.print(
            f"roofline @ batch {rl_batch_size}: {VIT_B16.forward_flops / 1e9:.1f} GFLOP/image in matmuls; eager "
            f"runs {eager_gflops:.0f} GFLOP/s = {eager_gflops / peak:.0%} of this CPU's fp32 matmul peak "
            f"({peak:.0f} GFLOP/s, 4096^3 sgemm); 1.7x eager would need {1.7 * eager_gflops / peak:.0%} of it; "
            f"best here: {best} {best_x:.2f}x")

    build_table = Table(title=f"Build time (export/compile + parity check at batch {rl_batch_size}), seconds")
    build_table.add_column("runtime")
    build_table.add_column("build s / why unavailable")
    for runtime, text in builds.items():
        build_table.add_row(runtime, text)
    console.print(build_table)

    t0 = time.perf_counter()
    auto = rr.make_scorer(net, item_shape, runtime="auto", batch_size=rl_batch_size, device=device,
                          cache_url=cache_url, model_name=model)
    auto_s = time.perf_counter() - t0
    measured = auto.report["runtimes"]
    eager_ms, pick_ms = measured["eager"]["median_ms"], measured[auto.runtime]["median_ms"]
    console.print(
        f"auto @ batch {rl_batch_size}: picks [bold]{auto.runtime}[/] — {pick_ms:.1f} ms vs eager {eager_ms:.1f} ms "
        f"= {eager_ms / pick_ms:.2f}x eager throughput (auto's own measurement, {auto_s:.0f}s incl. builds); "
        + ", ".join(f"{k}: {v['median_ms']:.1f} ms" if "median_ms" in v else f"{k}: refused"
                    for k, v in measured.items())
    )
    t0 = time.perf_counter()
    again = rr.make_scorer(net, item_shape, runtime="auto", batch_size=rl_batch_size, device=device,
                           cache_url=cache_url, model_name=model)
    console.print(f"auto again (same key): {again.runtime}, from_cache={again.report['from_cache']}, "
                  f"{time.perf_counter() - t0:.1f}s; cache: {auto.report['cache_dir']}")
    console.print(f"total bench time {time.perf_counter() - started:.0f}s, load avg 1 min now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    typer.run(main)
