"""Time to a target held-out reward for the three exploration modes, side by side in one run.

Each mode runs the real flow (`spotlight run`) on the same config and seed, with the trainer pinned
to one core and the exploration worker to the other (an on-demand trainer plus one spot worker).
Held-out reward is evaluated after every iteration (ODE, fixed seeds); evaluation and the ranking
measurement are not counted as training time. Wall-clock to target = the sum of the critical-path
seconds of the iterations up to the first one whose policy reaches the target.

    .venv/bin/python bench/time_to_target.py --iterations 20 --seeds 0,1
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


def main(targets: str = "0.95,0.96,0.97,0.975,0.98", iterations: int = 20, seeds: str = "0",
         out: Path = typer.Option(None), extra: list[str] = typer.Option([], "--set"),
         reuse: bool = typer.Option(False, help="print the tables for the runs already under --out; run nothing")) -> None:
    if reuse and out is None:
        raise typer.BadParameter("--reuse reads the runs of an earlier bench: give its --out")
    root = out or Path(tempfile.mkdtemp(prefix="time-to-target-"))
    console = Console()
    goals = [float(x) for x in targets.split(",")]
    seed_list = [int(s) for s in seeds.split(",")]
    curves: dict[str, list[tuple[list[float], list[float]]]] = {m: [] for m in MODES}
    for seed in seed_list:
        for mode in MODES:
            if not reuse:
                console.print(f"running mode {mode}, seed {seed} ...")
            run = root / f"{mode}-s{seed}" if reuse else run_mode(mode, seed, iterations, root, extra)
            curves[mode].append(curve(run, iterations))

    per_iter = {m: sum(sum(s) / len(s) for _, s in curves[m]) / len(seed_list) for m in MODES}
    table = Table(title=f"critical path per iteration (trainer on CPU 0, one exploration worker on CPU 1), "
                        f"mean of seeds {seeds}")
    for col in ("mode", "critical path s/iteration", "vs none", "held-out reward after the last iteration"):
        table.add_column(col)
    for mode in MODES:
        final = sum(e[-1] for e, _ in curves[mode]) / len(seed_list)
        table.add_row(mode, f"{per_iter[mode]:.2f}", f"{per_iter[mode] / per_iter['none']:.2f}x", f"{final:.3f}")
    console.print(table)

    table = Table(title=f"iterations and wall-clock seconds to a held-out reward target ({iterations} iterations "
                        f"at most; mean over seeds {seeds})")
    for col in ("target", *[f"{m}: iterations / s" for m in MODES], "spotlight x faster than none",
                "per seed"):
        table.add_column(col)
    for goal in goals:
        cells, secs = [], {}
        for mode in MODES:
            hits = [to_target(e, s, goal) for e, s in curves[mode]]
            if all(h[0] is not None for h in hits):
                its = sum(h[0] for h in hits) / len(hits)
                secs[mode] = sum(h[1] for h in hits) / len(hits)
                cells.append(f"{its:.1f} / {secs[mode]:.1f}")
            else:
                reached = sum(h[0] is not None for h in hits)
                cells.append(f"not reached ({reached}/{len(hits)} seeds)")
        if "spotlight" in secs and "none" in secs:
            ratio = f"{secs['none'] / secs['spotlight']:.2f}x"
        elif "spotlight" in secs:  # none never got there: its whole run is a lower bound on its time
            bound = sum(sum(s) for _, s in curves["none"]) / len(seed_list)
            ratio = f"> {bound / secs['spotlight']:.2f}x (none not reached)"
        else:
            ratio = "-"
        per_seed = []
        for (e_n, s_n), (e_s, s_s) in zip(curves["none"], curves["spotlight"]):
            (_, t_n), (_, t_s) = to_target(e_n, s_n, goal), to_target(e_s, s_s, goal)
            per_seed.append("-" if t_s is None else f">{sum(s_n) / t_s:.2f}" if t_n is None else f"{t_n / t_s:.2f}")
        table.add_row(f"{goal:.3f}", *cells, ratio, " ".join(per_seed))
    console.print(table)
    for mode in MODES:
        for seed, (evals, _) in zip(seed_list, curves[mode]):
            console.print(f"held-out reward, {mode} seed {seed}: " + " ".join(f"{v:.3f}" for v in evals))
    console.print(f"runs kept under {root}")


if __name__ == "__main__":
    typer.run(main)
