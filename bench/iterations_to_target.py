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

REPO = Path(__file__).resolve().parents[1]


def open_run(run_url: str, cache_url: str, seed: int, iterations: int, sets: list[str]):
    from spotlight.config import load_config
    from spotlight.run import open_run as open_library_run

    return open_library_run(load_config(REPO / "configs/tiny.yaml", [
        f"run.url={run_url}", f"run.cache_url={cache_url}", f"run.seed={seed}", f"grpo.iterations={iterations}",
        "exploration.workers=0", "evaluation.every=1", "exploration.ranking_every=0", *sets]))


def curve(run_url: str, cache_url: str, seed: int, iterations: int, sets: list[str]) -> list[float]:
    """Held-out reward of theta_1..theta_n for one config and seed (run in this process)."""
    from spotlight import stages

    run = open_run(run_url, cache_url, seed, iterations, sets)
    stages.pretrain(run)
    out = []
    for t in range(iterations):
        stages.update(run, t)
        out.append(stages.evaluate(run, t + 1).json("metrics.json")["eval_reward"])
    return out


def first_at(values: list[float], target: float) -> int | None:
    return next((i + 1 for i, v in enumerate(values) if v >= target), None)


def main(variant: list[str] = typer.Option(..., help="name:override,override,..."), seeds: str = "0,1",
         iterations: int = 20, targets: str = "0.95,0.96,0.97,0.98", out: Path = typer.Option(None)) -> None:
    root = out or Path(tempfile.mkdtemp(prefix="iterations-to-target-"))
    parsed = {v.split(":", 1)[0]: [s for s in v.split(":", 1)[1].split(",") if s] if ":" in v else []
              for v in variant}
    seed_list = [int(s) for s in seeds.split(",")]
    jobs = [(name, seed) for name in parsed for seed in seed_list]
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned runs
    cache = f"file://{root}/cache"
    from spotlight.stages import pretrain

    for seed in seed_list:  # the shared pretrained base first, so parallel runs do not race to build it
        pretrain(open_run(f"file://{root}/base-s{seed}", cache, seed, 1, []))
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {job: pool.submit(curve, f"file://{root}/{job[0]}-s{job[1]}", cache, job[1], iterations,
                                    parsed[job[0]]) for job in jobs}
        curves = {job: f.result() for job, f in futures.items()}
    goals = [float(t) for t in targets.split(",")]
    table = Table(title=f"iterations to a held-out reward target (mean over seeds {seeds}; "
                        f"'-' = not reached in {iterations} iterations by some seed)")
    for col in ("variant", "overrides", *[f"{g:.2f}" for g in goals], "final"):
        table.add_column(col)
    for name, sets in parsed.items():
        cells = []
        for goal in goals:
            hits = [first_at(curves[(name, s)], goal) for s in seed_list]
            cells.append("-" if None in hits else f"{sum(hits) / len(hits):.1f}")
        final = sum(curves[(name, s)][-1] for s in seed_list) / len(seed_list)
        table.add_row(name, " ".join(sets), *cells, f"{final:.3f}")
    console = Console(width=200)
    console.print(table)
    for (name, seed), values in curves.items():
        console.print(f"{name} seed {seed}: " + " ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    typer.run(main)
