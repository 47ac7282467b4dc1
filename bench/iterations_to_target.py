"""Iterations to a held-out reward target for exploration variants: an ablation without timing.

Each variant is a list of config overrides; its runs call the stage functions directly (exploration
in-process, evaluation after every iteration), so the held-out curve is exactly the one the flow
produces for that config and seed, but no wall-clock is measured: use `time_to_target.py` for that.
Variants run two at a time (one per core). Runs are deterministic, so a variant's curve is the one
`time_to_target.py` gets for the same overrides and seed.

    .venv/bin/python bench/iterations_to_target.py --seeds 0,1 \
        --variant none:exploration.mode=none --variant coarsen2:exploration.coarsen=2
"""

from __future__ import annotations

import json
import os
import multiprocessing
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from targets import fall_after_peak

REPO = Path(__file__).resolve().parents[1]


def open_run(run_url: str, cache_url: str, seed: int, iterations: int, sets: list[str]):
    from spotlight.config import load_config
    from spotlight.run import open_run as open_library_run

    return open_library_run(load_config(REPO / "configs/tiny.yaml", [
        f"run.url={run_url}", f"run.cache_url={cache_url}", f"run.seed={seed}", f"grpo.iterations={iterations}",
        "placement.explorer.workers=0", "evaluation.every=1", "exploration.ranking_every=0", *sets]))


def curve(run_url: str, cache_url: str, seed: int, iterations: int, sets: list[str]) -> dict[str, list[float]]:
    """Held-out reward of theta_1..theta_n for one config and seed (run in this process), with the
    update's diagnostics per iteration and the quality metrics of the last policy."""
    from spotlight import stages

    run = open_run(run_url, cache_url, seed, iterations, sets)
    stages.pretrain(run)
    out: dict[str, list[float]] = {"eval_reward": [], "clip_frac": [], "mean_abs_log_ratio": [], "approx_kl": [],
                                   "diversity_vs_base": [], "realism_digits": []}
    for t in range(iterations):
        update = stages.update(run, t).json("metrics.json")
        for key in ("clip_frac", "mean_abs_log_ratio", "approx_kl"):
            out[key].append(update.get(key, float("nan")))
        metrics = stages.evaluate(run, t + 1).json("metrics.json")
        for key in ("eval_reward", "diversity_vs_base", "realism_digits"):
            out[key].append(metrics.get(key))
    for t in (0, iterations):  # quality the reward does not see, when the evaluation records it
        metrics = stages.evaluate(run, t).json("metrics.json")
        for key in ("diversity", "realism_digits"):
            if key in metrics:
                out.setdefault(f"{key}_{'base' if t == 0 else 'last'}", []).append(metrics[key])
    return out


def first_at(values: list[float], target: float) -> int | None:
    return next((i + 1 for i, v in enumerate(values) if v >= target), None)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def main(variant: list[str] = typer.Option(..., help="name:override,override,..."), seeds: str = "0,1",
         iterations: int = 20, targets: str = "0.95,0.96,0.97,0.98", out: Path = typer.Option(None),
         parallel: int = typer.Option(2, help="runs in parallel (one core each)")) -> None:
    root = out or Path(tempfile.mkdtemp(prefix="iterations-to-target-"))
    parsed = {v.split(":", 1)[0]: [s for s in v.split(":", 1)[1].split(",") if s] if ":" in v else []
              for v in variant}
    seed_list = [int(s) for s in seeds.split(",")]
    jobs = [(name, seed) for name in parsed for seed in seed_list]
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned runs
    cache = f"file://{root}/cache"
    from spotlight.queue_worker import term_with_parent
    from spotlight.stages import pretrain

    from spotlight.config import load_config

    defaults = load_config(REPO / "configs/tiny.yaml").fingerprint()  # a base run per config file version
    for seed in seed_list:  # the shared pretrained base first, so parallel runs do not race to build it
        pretrain(open_run(f"file://{root}/base-{defaults}-s{seed}", cache, seed, 1, []))
    # the runs get SIGTERM when this process dies (even by kill -9): no orphan keeps writing run folders
    with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn"),
                             initializer=term_with_parent) as pool:
        futures = {job: pool.submit(curve, f"file://{root}/{job[0]}-s{job[1]}", cache, job[1], iterations,
                                    parsed[job[0]]) for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    curves = {job: r["eval_reward"] for job, r in results.items()}
    (root / "summary.json").write_text(json.dumps({f"{n}|{s}": r for (n, s), r in results.items()}, indent=1))
    goals = [float(t) for t in targets.split(",")]
    table = Table(title=f"iterations to a held-out reward target (mean over the seeds {seeds} that reached it; "
                        f"(k/n): only k of the n seeds reached it in {iterations} iterations)")
    for col in ("variant", "overrides", *[f"{g:.2f}" for g in goals], "final", "mean of last 5",
                "fall after the peak, last 5 (worst seed)"):
        table.add_column(col)
    for name, sets in parsed.items():
        cells = []
        for goal in goals:
            hits = [h for h in (first_at(curves[(name, s)], goal) for s in seed_list) if h is not None]
            cell = "-" if not hits else f"{mean(hits):.1f}"
            cells.append(cell if len(hits) == len(seed_list) else f"{cell} ({len(hits)}/{len(seed_list)})")
        final = mean([curves[(name, s)][-1] for s in seed_list])
        last5 = mean([mean(curves[(name, s)][-5:]) for s in seed_list])
        falls = [fall_after_peak(curves[(name, s)]) for s in seed_list]
        table.add_row(name, " ".join(sets), *cells, f"{final:.3f}", f"{last5:.3f}",
                      f"{mean(falls):.4f} ({max(falls):.4f})")
    console = Console(width=200)
    console.print(table)
    table = Table(title="the update's log-ratio scale and clipping (mean over iterations and seeds), and quality "
                        "of the last policy relative to the base (diversity: within-prompt; realism_digits: "
                        "distance to real digits, lower is better)")
    for col in ("variant", "mean |log ratio|", "clip_frac", "iterations with clip_frac > 0", "approx_kl",
                "diversity last/base", "realism_digits last (base)"):
        table.add_column(col)
    for name in parsed:
        rs = [results[(name, s)] for s in seed_list]
        clipped = sum(sum(c > 0 for c in r["clip_frac"]) for r in rs)
        div = (f"{mean([r['diversity_last'][0] / r['diversity_base'][0] for r in rs]):.3f}"
               if all("diversity_last" in r for r in rs) else "n/a")
        real = (f"{mean([r['realism_digits_last'][0] for r in rs]):.3f} "
                f"({mean([r['realism_digits_base'][0] for r in rs]):.3f})"
                if all("realism_digits_last" in r for r in rs) else "n/a")
        table.add_row(name, f"{mean([mean(r['mean_abs_log_ratio']) for r in rs]):.2e}",
                      f"{mean([mean(r['clip_frac']) for r in rs]):.4f}", f"{clipped}/{iterations * len(rs)}",
                      f"{mean([mean(r['approx_kl']) for r in rs]):.2e}", div, real)
    console.print(table)
    for (name, seed), values in curves.items():
        console.print(f"{name} seed {seed}: " + " ".join(f"{v:.3f}" for v in values))
    console.print(f"runs under {root}")


if __name__ == "__main__":
    typer.run(main)
