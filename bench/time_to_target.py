"""Time to a target held-out reward for the three exploration modes, side by side in one run.

Each mode runs the real flow (`spotlight run`) on the same config and seed, with the trainer pinned
to one core and the exploration worker to the other (an on-demand trainer plus one spot worker).
Held-out reward is evaluated after every iteration (ODE, fixed seeds); evaluation and the ranking
measurement are not counted as training time. Wall-clock to target = the sum of the critical-path
seconds of the iterations up to the first one whose policy reaches the target. Speed-ups over
`none` are exact only where both runs reached the target; a run that did not bounds them with its
whole run (arithmetic in `bench/targets.py`).

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
from targets import Curve, hits, reached_summary, speedups

REPO = Path(__file__).resolve().parents[1]
MODES = ("none", "sync", "spotlight")
BASELINE = "none"


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


def curve(run: Path, iterations: int) -> Curve:
    """Held-out reward of theta_1..theta_n and critical-path seconds of iterations 0..n-1."""
    evals = [json.loads((run / f"evaluations/{t:04d}/metrics.json").read_text())["eval_reward"]
             for t in range(1, iterations + 1)]
    seconds = [json.loads((run / f"timeline/{t:04d}.json").read_text())["critical_path_seconds"]
               for t in range(iterations)]
    return evals, seconds


def main(targets: str = "0.95,0.96,0.97,0.975,0.98", iterations: int = 20, seeds: str = "0",
         out: Path = typer.Option(None), extra: list[str] = typer.Option([], "--set"),
         reuse: bool = typer.Option(False, help="print the tables for the runs already under --out; run nothing")) -> None:
    if reuse and out is None:
        raise typer.BadParameter("--reuse reads the runs of an earlier bench: give its --out")
    root = out or Path(tempfile.mkdtemp(prefix="time-to-target-"))
    console = Console()
    goals = [float(x) for x in targets.split(",")]
    seed_list = [int(s) for s in seeds.split(",")]
    curves: dict[str, list[Curve]] = {m: [] for m in MODES}
    for seed in seed_list:
        for mode in MODES:
            if not reuse:
                console.print(f"running mode {mode}, seed {seed} ...")
            run = root / f"{mode}-s{seed}" if reuse else run_mode(mode, seed, iterations, root, extra)
            curves[mode].append(curve(run, iterations))

    per_iter = {m: sum(sum(s) / len(s) for _, s in curves[m]) / len(seed_list) for m in MODES}
    table = Table(title=f"critical path per iteration (trainer on CPU 0, one exploration worker on CPU 1), "
                        f"mean of seeds {seeds}")
    for col in ("mode", "critical path s/iteration", f"vs {BASELINE}", "held-out reward after the last iteration"):
        table.add_column(col)
    for mode in MODES:
        final = sum(e[-1] for e, _ in curves[mode]) / len(seed_list)
        table.add_row(mode, f"{per_iter[mode]:.2f}", f"{per_iter[mode] / per_iter[BASELINE]:.2f}x", f"{final:.3f}")
    console.print(table)

    table = Table(title=f"critical-path seconds to a held-out reward target ({iterations} iterations at most, "
                        f"seeds {seeds})",
                  caption=f"iterations, seconds: mean [95% t-interval] over the n seeds that reached the target. "
                          f"x faster: mean {BASELINE} seconds / mean mode seconds over all seeds, each seed "
                          f"that did not reach it counted with its whole run (a lower bound on its time): "
                          f"'>' a lower bound, '<' an upper bound, '-' unknown; per seed (paired) the same.")
    for col in ("target", "mode", "seeds reached", "iterations", "seconds", f"x faster than {BASELINE}", "per seed"):
        table.add_column(col)
    for goal in goals:
        by_mode = hits(curves, goal)
        summary, ratios = reached_summary(by_mode), speedups(by_mode, BASELINE)
        for mode in MODES:
            its, secs, reached = summary[mode]
            mean, per_seed = ratios.get(mode, (None, []))
            table.add_row(f"{goal:.3f}", mode, reached, "-" if its is None else f"{its.mean:.1f}",
                          "not reached" if secs is None else str(secs),
                          "" if mode == BASELINE else str(mean or "-"),
                          " ".join(str(r or "-") for r in per_seed))
        table.add_section()
    console.print(table)
    for mode in MODES:
        for seed, (evals, _) in zip(seed_list, curves[mode]):
            console.print(f"held-out reward, {mode} seed {seed}: " + " ".join(f"{v:.3f}" for v in evals))
    console.print(f"runs kept under {root}")


if __name__ == "__main__":
    typer.run(main)
