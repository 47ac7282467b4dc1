"""Iterations to a held-out reward target against exploration width: candidates per prompt, K, at a fixed group G.

Each width W is a spotlight run in which every explored prompt gets exactly W candidate seeds
(``exploration.candidates_per_prompt = max_candidates_per_prompt = W``, and a planner budget,
``budget_scale = 4``, that never binds), so the width is the one thing that changes. Runs go through
``bench/iterations_to_target.py`` (stage functions in-process, exploration inline, an evaluation after
every iteration): iterations to a target do not depend on the machine's load, and a run's numbers do
not depend on which worker explored (units are deterministic per seed batch). The explorer count is
therefore not a bench axis: more explorers (or the CPU's stand-in, more explorer seconds per iteration)
only let a wider exploration finish in the update's time, which is what ``spotlight simulate --widths``
prices.

    OMP_NUM_THREADS=1 .venv/bin/python bench/width_sweep.py --widths 16,32,64,128 --seeds 0,1,2,3,4 --out /tmp/width
    OMP_NUM_THREADS=1 .venv/bin/python bench/width_sweep.py --widths 16,32,64,128 --seeds 0,1,2,3,4 --out /tmp/width --reuse
"""

from __future__ import annotations

from pathlib import Path
from statistics import fmean

import typer
from rich.console import Console
from rich.table import Table
from targets import t_interval

from spotlight.config import load_config
from spotlight.forecast.curves import by_label
from spotlight.forecast.records import runs_in
from spotlight.planner import update_cost_forwards

REPO = Path(__file__).resolve().parents[1]


def variant(width: int) -> str:
    return (f"w{width}:exploration.candidates_per_prompt={width},exploration.max_candidates_per_prompt={width},"
            "exploration.budget_scale=4")


def main(widths: str = "16,32,64,128", seeds: str = "0,1,2", iterations: int = 20,
         targets: str = "0.95,0.96,0.97,0.975,0.98", out: Path = typer.Option(...),
         reuse: bool = typer.Option(False, help="print the table for the runs already under --out; run nothing")) -> None:
    chosen = [int(w) for w in widths.split(",")]
    if not reuse:
        import iterations_to_target

        iterations_to_target.main(variant=[variant(w) for w in chosen], seeds=seeds, iterations=iterations,
                                  targets=targets, out=out, parallel=2)
    cfg = load_config(REPO / "configs/tiny.yaml")
    update = update_cost_forwards(cfg.grpo.prompts_per_iteration * cfg.grpo.group_size, cfg.sampler.train_steps,
                                  cfg.grpo.kl_beta > 0, cfg.trained_steps)
    records = runs_in(out, tuple(f"w{w}" for w in chosen))
    curves = by_label([r.curve for r in records])
    goals = [float(t) for t in targets.split(",")]
    table = Table(title=f"iterations to a held-out reward target by exploration width (digits, G = "
                        f"{cfg.grpo.group_size}, {cfg.grpo.prompts_per_iteration} + {cfg.exploration.extra_prompts} "
                        f"prompts explored; mean [95% t-interval] over the seeds that reached it, of {seeds})")
    for col in ("variant", "K per prompt (measured)", "K/G", "exploration / update forwards",
                *[f"{g:g}" for g in goals], "held-out, last"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for label, runs in sorted(curves.items(), key=lambda kv: int(kv[0][1:])):
        width = fmean(r.width for r in records if r.label == label)
        explored = (cfg.grpo.prompts_per_iteration + cfg.exploration.extra_prompts) * width * cfg.exploration_steps
        cells = []
        for goal in goals:
            hit = [c.iterations_to(goal) for c in runs]
            reached = [h for h in hit if h is not None]
            interval = t_interval(reached)
            cell = "-" if interval is None else (f"{interval.mean:.1f}" if interval.low is None else
                                                 f"{interval.mean:.1f} [{interval.low:.1f}, {interval.high:.1f}]")
            cells.append(f"{cell} ({len(reached)}/{len(hit)})")
        table.add_row(label, f"{width:.0f}", f"{width / cfg.grpo.group_size:.0f}", f"{explored / update:.2f}", *cells,
                      f"{fmean(c.rewards[-1][1] for c in runs):.3f}")
    console = Console(width=220)
    console.print(table)
    for label, runs in curves.items():
        for c in runs:
            console.print(f"{label} seed {c.seed}: " + " ".join(f"{r:.3f}" for _, r in c.rewards[1:]))


if __name__ == "__main__":
    typer.run(main)
