"""Issue 17's quality goal judged over many seeds, with intervals, instead of a five-seed mean crossing a line.

Reads the ``summary.json`` files that `iterations_to_target.py` writes, or the ``--out`` folders of runs of
either bench (several may be merged: a seed present in more than one must agree), and compares a method variant with a baseline
variant on the seeds both have: held-out reward at theta_N, diversity relative to the base, the fall
after the peak over the last 5 iterations, and realism paired by seed (the method's minus the baseline's,
lower is better). Each row gives the mean, its 95% t-interval over the seeds, and whether the goal holds
by the mean and at 95% confidence (the whole interval on the goal's side).

    .venv/bin/python bench/quality_goal.py /tmp/mix/summary.json /tmp/ttt \
        --method mix16g8kl21,spotlight --baseline none16kl21,none-dp2-16p
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from targets import fall_after_peak, t_interval


def from_summary(path: Path) -> dict[tuple[str, int], dict[str, list[float]]]:
    out = {}
    for key, run in json.loads(path.read_text()).items():
        name, seed = key.rsplit("|", 1)
        out[(name, int(seed))] = {k: run[k] for k in ("eval_reward", "diversity_vs_base", "realism_digits")}
    return out


def from_runs(root: Path, iterations: int) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Run directories named ``{variant}-s{seed}`` (`time_to_target.py`'s and `iterations_to_target.py`'s
    ``--out``) that evaluated every policy up to theta_``iterations``; the others are skipped."""
    from spotlight.store import RunStore

    out = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and "-s" in p.name):
        name, seed = run_dir.name.rsplit("-s", 1)
        store = RunStore(f"file://{run_dir}")
        if not seed.isdigit() or not store.is_committed(f"evaluations/{iterations:04d}"):
            continue
        metrics = [store.load(f"evaluations/{t:04d}").json("metrics.json") for t in range(1, iterations + 1)]
        out[(name, int(seed))] = {k: [m.get(k) for m in metrics]
                                  for k in ("eval_reward", "diversity_vs_base", "realism_digits")}
    return out


def load(paths: list[Path], iterations: int, names: dict[str, str]) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Every input's runs of the variants in ``names`` (a name in the inputs -> the variant it is), cut to
    ``iterations``; a variant's seed found more than once must be the same run."""
    runs: dict[tuple[str, int], dict[str, list[float]]] = {}
    for path in paths:
        for (name, seed), run in (from_runs(path, iterations) if path.is_dir() else from_summary(path)).items():
            if name not in names:
                continue
            run = {k: v[:iterations] for k, v in run.items()}
            if len(run["eval_reward"]) < iterations:
                raise typer.BadParameter(f"{name} seed {seed} in {path} has {len(run['eval_reward'])} evaluations")
            if runs.setdefault((names[name], seed), run) != run:
                raise typer.BadParameter(f"{names[name]} seed {seed} differs between the inputs (not one config?)")
    return runs


def paired(inputs: list[Path], iterations: int, first: str, second: str, seeds: str
           ) -> tuple[dict[tuple[str, int], dict[str, list[float]]], str, str, list[int]]:
    """The runs of two variants (each ``name,alias,...``), their names, and the seeds to pair them on:
    ``seeds`` (comma-separated) or, when empty, every seed both have; at least two."""
    names = {n: v.split(",")[0] for v in (first, second) for n in v.split(",")}
    first, second = first.split(",")[0], second.split(",")[0]
    runs = load(inputs, iterations, names)
    have = sorted(s for (n, s) in runs if n == first and (second, s) in runs)
    chosen = [int(s) for s in seeds.split(",")] if seeds else have
    missing = sorted(set(chosen) - set(have))
    if len(chosen) < 2 or missing:
        raise typer.BadParameter(f"need >= 2 seeds run with both {first} and {second}; missing {missing}")
    return runs, first, second, chosen


def main(inputs: list[Path] = typer.Argument(..., help="summary.json files or --out folders of runs"),
         method: str = typer.Option(..., help="the variant's names in the inputs, comma-separated (one config)"),
         baseline: str = typer.Option(..., help="likewise, e.g. none16kl21,none-dp2-16p"), iterations: int = 20,
         seeds: str = typer.Option("", help="comma-separated; default: every seed both variants have"),
         min_held_out: float = 0.98, min_diversity: float = 0.85, max_fall: float = 0.005) -> None:
    runs, method, baseline, chosen = paired(inputs, iterations, method, baseline, seeds)
    ours = [runs[(method, s)] for s in chosen]
    base = [runs[(baseline, s)] for s in chosen]
    per_seed = {
        f"held-out reward, theta_{iterations}": ([r["eval_reward"][-1] for r in ours], ">=", min_held_out),
        "diversity vs base": ([r["diversity_vs_base"][-1] for r in ours], ">=", min_diversity),
        "fall after the peak, last 5": ([fall_after_peak(r["eval_reward"]) for r in ours], "<=", max_fall),
        f"realism minus {baseline}'s": ([a["realism_digits"][-1] - b["realism_digits"][-1]
                                         for a, b in zip(ours, base)], "<=", 0.0),
    }
    console = Console(width=200)
    table = Table(title=f"{method} against {baseline}, seeds {','.join(map(str, chosen))} "
                        f"({len(chosen)}; mean [95% t-interval])")
    for col in ("quantity", "goal", "mean [95% interval]", "met by the mean", "met at 95%", "seeds that meet it"):
        table.add_column(col)
    for what, (values, side, goal) in per_seed.items():
        m, lo, hi = (iv := t_interval(values)).mean, iv.low, iv.high
        by_mean, sure = (m >= goal, lo >= goal) if side == ">=" else (m <= goal, hi <= goal)
        meet = sum(v >= goal if side == ">=" else v <= goal for v in values)
        table.add_row(what, f"{side} {goal:g}", f"{m:.4f} [{lo:.4f}, {hi:.4f}]", "yes" if by_mean else "no",
                      "yes" if sure else "no", f"{meet}/{len(values)}")
    console.print(table)
    for s, r, b, (held, div, fall, real) in zip(chosen, ours, base, zip(*(v for v, _, _ in per_seed.values()))):
        console.print(f"seed {s}: held-out {held:.4f}  diversity {div:.4f}  fall {fall:.4f}  realism "
                      f"{r['realism_digits'][-1]:.4f} vs {b['realism_digits'][-1]:.4f} ({real:+.4f})")


if __name__ == "__main__":
    typer.run(main)
