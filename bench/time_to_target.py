"""Time to a target held-out reward for the three exploration modes, side by side in one run.

Each mode runs the real flow (`spotlight run`) on the same config and seed, with the trainer pinned
to one core and the exploration worker to the other (an on-demand trainer plus one spot worker).
Held-out reward is evaluated after every iteration (ODE, fixed seeds); evaluation and the ranking
measurement are not counted as training time. Wall-clock to target = the sum of the critical-path
seconds of the iterations up to the first one whose policy reaches the target.

    .venv/bin/python bench/time_to_target.py --target 0.97 --iterations 20
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "sync", "spotlight")


def run_mode(mode: str, seed: int, iterations: int, root: Path, extra: list[str]) -> Path:
    run = root / f"{mode}-s{seed}"
    sets = [f"run.url=file://{run}", f"run.cache_url=file://{root}/cache", f"run.seed={seed}",
            f"exploration.mode={mode}", f"grpo.iterations={iterations}", "evaluation.every=1",
            "run.cpus=[0]", "exploration.worker_cpus=[1]", "exploration.workers=1", *extra]
    cmd = [str(Path(sys.executable).with_name("spotlight")), "run", "--config", str(REPO / "configs/tiny.yaml"),
           *[a for s in sets for a in ("--set", s)]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PREFECT_LOGGING_LEVEL="WARNING",
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return run


def curve(run: Path, iterations: int) -> tuple[list[float], list[float]]:
    """Held-out reward of theta_1..theta_n and critical-path seconds of iterations 0..n-1."""
    evals = [json.loads((run / f"evaluations/{t:04d}/metrics.json").read_text())["eval_reward"]
             for t in range(1, iterations + 1)]
    seconds = [json.loads((run / f"timeline/{t:04d}.json").read_text())["critical_path_seconds"]
               for t in range(iterations)]
    return evals, seconds


def to_target(evals: list[float], seconds: list[float], target: float) -> tuple[int | None, float | None]:
    for i, value in enumerate(evals):
        if value >= target:
            return i + 1, sum(seconds[: i + 1])
    return None, None


def main(target: float = 0.97, iterations: int = 20, seeds: str = "0", out: Path = typer.Option(None),
         extra: list[str] = typer.Option([], "--set")) -> None:
    root = out or Path(tempfile.mkdtemp(prefix="time-to-target-"))
    console = Console()
    results: dict[str, list[tuple[int | None, float | None, float]]] = {m: [] for m in MODES}
    for seed in [int(s) for s in seeds.split(",")]:
        for mode in MODES:
            console.print(f"running mode {mode}, seed {seed} ...")
            evals, seconds = curve(run_mode(mode, seed, iterations, root, extra), iterations)
            its, secs = to_target(evals, seconds, target)
            results[mode].append((its, secs, sum(seconds) / len(seconds)))
    table = Table(title=f"time to held-out reward >= {target} (trainer on CPU 0, one exploration worker on CPU 1)")
    for col in ("mode", "iterations to target", "wall-clock s to target", "x faster than none",
                "critical path s/iteration", "vs none"):
        table.add_column(col)

    def mean(xs: list[float | None]) -> float | None:
        return None if any(x is None for x in xs) else sum(xs) / len(xs)

    base_secs = mean([r[1] for r in results["none"]])
    base_iter = mean([r[2] for r in results["none"]])
    for mode in MODES:
        its, secs, per_it = mean([r[0] for r in results[mode]]), mean([r[1] for r in results[mode]]), \
            mean([r[2] for r in results[mode]])
        table.add_row(mode, "not reached" if its is None else f"{its:.1f}",
                      "-" if secs is None else f"{secs:.1f}",
                      "-" if secs is None or base_secs is None else f"{base_secs / secs:.2f}x",
                      f"{per_it:.2f}", f"{per_it / base_iter:.2f}x")
    console.print(table)
    console.print(f"runs kept under {root}")


if __name__ == "__main__":
    typer.run(main)
