"""Issue 17's quality goal judged over many seeds, with intervals, instead of a five-seed mean crossing a line.

Reads the ``summary.json`` files that `iterations_to_target.py` writes, or the ``--out`` folders of runs of
either bench (several may be merged: a seed present in more than one must agree), and compares a method variant with a baseline
variant on the seeds both have: held-out reward at theta_N, diversity relative to the base, the fall
after the peak over the last 5 iterations, and realism paired by seed (the method's minus the baseline's,
lower is better). Each row gives the mean, its 95% t-interval over the seeds, and whether the goal holds
by the mean and at 95% confidence (the whole interval on the goal's side).

A run evaluates on 16 seeds per held-out prompt, and which 16 moves one policy's held-out reward by about
0.009 (standard deviation): ``--seeds-per-prompt 256`` re-evaluates theta_N of every run folder on 256
(`reevaluate.py`, cached beside the runs), judges the theta_N rows on those, and prints how much of the
seed-to-seed spread of the runs' own evaluations was that sampling noise.

    .venv/bin/python bench/quality_goal.py /tmp/mix/summary.json /tmp/ttt \
        --method mix16g8kl21,spotlight --baseline none16kl21,none-dp2-16p
    .venv/bin/python bench/quality_goal.py /work/benchruns/q20e2 --method mix16g8kl21e2 --baseline none16kl21e2 \
        --seeds-per-prompt 256
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from statistics import fmean, stdev

import typer
from rich.console import Console
from rich.table import Table
from reevaluate import QUANTITIES, reevaluated
from targets import fall_after_peak, t_interval


def from_summary(path: Path) -> dict[tuple[str, int], dict[str, list[float]]]:
    out = {}
    for key, run in json.loads(path.read_text()).items():
        name, seed = key.rsplit("|", 1)
        out[(name, int(seed))] = {k: run[k] for k in QUANTITIES}
    return out


def from_runs(root: Path, iterations: int) -> dict[tuple[str, int], dict[str, list[float]]]:
    """Run directories named ``{variant}-s{seed}`` (`time_to_target.py`'s and `iterations_to_target.py`'s
    ``--out``) that evaluated every policy up to theta_``iterations``; the others are skipped."""
    from spotlight.store import RunStore

    out = {}
    for name, seed, run_dir in run_folders(root):
        store = RunStore(f"file://{run_dir}")
        if not store.is_committed(f"evaluations/{iterations:04d}"):
            continue
        metrics = [store.load(f"evaluations/{t:04d}").json("metrics.json") for t in range(1, iterations + 1)]
        out[(name, seed)] = {k: [m.get(k) for m in metrics] for k in QUANTITIES}
    return out


def run_folders(root: Path) -> Iterator[tuple[str, int, Path]]:
    """The benches' run folders ``{variant}-s{seed}`` under ``root``: (variant, seed, folder)."""
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and "-s" in p.name):
        name, seed = run_dir.name.rsplit("-s", 1)
        if seed.isdigit():
            yield name, int(seed), run_dir


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


def variant_names(*variants: str) -> dict[str, str]:
    """Each name a variant has in the inputs (``name,alias,...``) -> the variant's first name."""
    return {n: v.split(",")[0] for v in variants for n in v.split(",")}


def at_theta_n(inputs: list[Path], variants: dict[str, str], chosen: list[int], iterations: int,
               seeds_per_prompt: int, parallel: int) -> dict[tuple[str, int], list[dict[str, float]]]:
    """Each run of ``variants`` (``variant_names``) on the chosen seeds re-evaluated at theta_``iterations``
    on ``seeds_per_prompt`` seeds per held-out prompt: the whole, then each chunk of the run's own
    evaluation size (`reevaluate.py`). Needs the run folders, not summary.json files."""
    folders = {}
    for root in (p for p in inputs if p.is_dir()):
        for name, seed, run_dir in run_folders(root):
            if name in variants and seed in chosen:
                folders.setdefault((variants[name], seed), run_dir)
    missing = sorted({(v, s) for v in variants.values() for s in chosen} - set(folders))
    if missing:
        raise typer.BadParameter(f"--seeds-per-prompt re-evaluates run folders; none found for {missing}")
    rows = reevaluated(list(folders.values()), iterations, seeds_per_prompt, parallel)
    return {run: rows[folder] for run, folder in folders.items()}


def paired(inputs: list[Path], iterations: int, first: str, second: str, seeds: str
           ) -> tuple[dict[tuple[str, int], dict[str, list[float]]], str, str, list[int]]:
    """The runs of two variants (each ``name,alias,...``), their names, and the seeds to pair them on:
    ``seeds`` (comma-separated) or, when empty, every seed both have; at least two."""
    names = variant_names(first, second)
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
         seeds_per_prompt: int = typer.Option(0, help="re-evaluate theta_N of every run on this many seeds per "
                                              "held-out prompt (a multiple of the runs' own), from the run "
                                              "folders: the theta_N rows without most of one evaluation's "
                                              "sampling noise; 0: the runs' own evaluations"),
         parallel: int = typer.Option(2, help="re-evaluations in parallel (one core each)"),
         min_held_out: float = 0.98, min_diversity: float = 0.85, max_fall: float = 0.005) -> None:
    variants = variant_names(method, baseline)
    runs, method, baseline, chosen = paired(inputs, iterations, method, baseline, seeds)
    own = {run: {k: curves[k][-1] for k in QUANTITIES} for run, curves in runs.items()}
    rows = at_theta_n(inputs, variants, chosen, iterations, seeds_per_prompt, parallel) if seeds_per_prompt else None
    last = {run: rows[run][0] for run in rows} if rows else own

    def theta_n(variant: str, key: str) -> list[float]:
        return [last[(variant, s)][key] for s in chosen]

    realism_gap = [a - b for a, b in zip(theta_n(method, "realism_digits"), theta_n(baseline, "realism_digits"))]
    per_seed = {
        f"held-out reward, theta_{iterations}": (theta_n(method, "eval_reward"), ">=", min_held_out),
        "diversity vs base": (theta_n(method, "diversity_vs_base"), ">=", min_diversity),
        "fall after the peak, last 5": ([fall_after_peak(runs[(method, s)]["eval_reward"]) for s in chosen], "<=",
                                        max_fall),
        f"realism minus {baseline}'s": (realism_gap, "<=", 0.0),
    }
    yardstick = (f"theta_{iterations} on {seeds_per_prompt} seeds per held-out prompt" if seeds_per_prompt else
                 "the runs' own evaluations")
    console = Console(width=200)
    table = Table(title=f"{method} against {baseline}, seeds {','.join(map(str, chosen))} "
                        f"({len(chosen)}; mean [95% t-interval]; {yardstick})")
    for col in ("quantity", "goal", "mean [95% interval]", "met by the mean", "met at 95%", "seeds that meet it"):
        table.add_column(col)
    for what, (values, side, goal) in per_seed.items():
        m, lo, hi = (iv := t_interval(values)).mean, iv.low, iv.high
        by_mean, sure = (m >= goal, lo >= goal) if side == ">=" else (m <= goal, hi <= goal)
        meet = sum(v >= goal if side == ">=" else v <= goal for v in values)
        table.add_row(what, f"{side} {goal:g}", f"{m:.4f} [{lo:.4f}, {hi:.4f}]", "yes" if by_mean else "no",
                      "yes" if sure else "no", f"{meet}/{len(values)}")
    console.print(table)
    if rows:
        console.print(sampling_noise(rows, own, method, baseline, chosen, seeds_per_prompt))
    for s, (held, div, fall, real) in zip(chosen, zip(*(v for v, _, _ in per_seed.values()))):
        ours, theirs = last[(method, s)]["realism_digits"], last[(baseline, s)]["realism_digits"]
        console.print(f"seed {s}: held-out {held:.4f}  diversity {div:.4f}  fall {fall:.4f}  realism "
                      f"{ours:.4f} vs {theirs:.4f} ({real:+.4f})" + (
                          f"  | its own evaluation: held-out {own[(method, s)]['eval_reward']:.4f}  diversity "
                          f"{own[(method, s)]['diversity_vs_base']:.4f}  realism "
                          f"{own[(method, s)]['realism_digits'] - own[(baseline, s)]['realism_digits']:+.4f}"
                          if rows else ""))


def sampling_noise(rows: dict[tuple[str, int], list[dict[str, float]]], own: dict[tuple[str, int], dict[str, float]],
                   method: str, baseline: str, chosen: list[int], seeds_per_prompt: int) -> Table:
    """How much of the seed-to-seed spread of the runs' own evaluations is the sampling noise of one
    evaluation: the spread of one policy's value over chunks of the run's evaluation size, against the
    spread over seeds with the runs' own evaluation and with ``seeds_per_prompt`` seeds per prompt."""
    def gap(row_a: dict[str, float], row_b: dict[str, float]) -> float:
        return row_a["realism_digits"] - row_b["realism_digits"]

    chunks = len(rows[(method, chosen[0])]) - 1
    table = Table(title=f"sampling noise: one evaluation's value over {chunks} disjoint seed sets of the runs' "
                        f"size (standard deviation, root mean square over the seeds) against the spread over "
                        f"seeds (standard deviation)")
    for col in ("quantity, theta_N", "one evaluation's noise", "over seeds, the runs' own evaluations",
                f"over seeds, {seeds_per_prompt} seeds per prompt", "share of the own evaluations' variance that "
                "is noise", "first chunk minus the run's own evaluation (largest)"):
        table.add_column(col)
    for what, value in (("held-out reward", lambda a, b: a["eval_reward"]),
                        ("diversity vs base", lambda a, b: a["diversity_vs_base"]), ("realism minus the baseline's", gap)):
        noise = fmean(stdev([value(a, b) for a, b in zip(rows[(method, s)][1:], rows[(baseline, s)][1:])]) ** 2
                      for s in chosen) ** 0.5
        by_own = stdev([value(own[(method, s)], own[(baseline, s)]) for s in chosen])
        by_rows = stdev([value(rows[(method, s)][0], rows[(baseline, s)][0]) for s in chosen])
        first = max(abs(value(rows[(method, s)][1], rows[(baseline, s)][1]) - value(own[(method, s)], own[(baseline, s)]))
                    for s in chosen)
        table.add_row(what, f"{noise:.4f}", f"{by_own:.4f}", f"{by_rows:.4f}", f"{noise**2 / by_own**2:.0%}" if by_own else "-",
                      f"{first:.1e}")
    return table


if __name__ == "__main__":
    typer.run(main)
