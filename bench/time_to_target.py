"""Time to a target held-out reward, with compute-matched baselines and ablations, side by side in one run.

Modes, each on the same config and run seeds (paired: every mode's first G seeds of a prompt are the
seeds `none` trains on), on two cores:

  none             plain Flow-GRPO, random seeds, one process on CPU 0 (1 core)
  none-dp2         plain Flow-GRPO on both cores: a 2-rank data-parallel run (bench/data_parallel_run.py
                   under torchrun, one rank per core): each rank rolls out half the prompt groups and
                   trains half of every minibatch. Same batch and numbers as `none`, less time per
                   iteration: one way a user of plain Flow-GRPO uses a second GPU (2 cores)
  none-dp2-16p     the other way: twice the batch on the two ranks (16 prompts x G, minibatches of 128
                   rows: each rank does what `none` does alone, flow_grpo's fixed per-GPU batch), so
                   about `none`'s time per iteration, fewer iterations (2 cores)
  sync             exploration with fresh weights on the critical path (trainer CPU 0 + worker CPU 1)
  spotlight        stale exploration overlapped with the update (trainer CPU 0 + worker CPU 1)
  prompt-select    ablation: spotlight, but each kept prompt trains its first G seeds (prompts selected only)
  seed-select      ablation: spotlight, but no extra prompts (seeds selected only)

Held-out reward is evaluated after every iteration (ODE, fixed seeds); evaluation and the ranking
measurement are not counted. Seconds to target = the sum of the critical-path seconds of the
iterations up to the first one whose policy reaches the target. Busy core-seconds count every
trainer process for the whole critical path plus the workers' rollout seconds (from each
exploration's `explore/stats.json`; the trainer's own share of an exploration is inside its critical
path). Speed-ups are exact only where both runs reached the target; a run that did not bounds them
with its whole run (arithmetic and t-intervals in `bench/targets.py`); `--baseline-iterations 40` runs
the baselines longer, so that a baseline that reaches the target late is timed instead of bounded,
and `--run-iterations` the other modes (quality is still compared at theta_ITERATIONS).

    OMP_NUM_THREADS=1 .venv/bin/python bench/time_to_target.py --iterations 20 --seeds 0,1,2,3,4 --out /tmp/ttt
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean

import typer
from rich.console import Console
from rich.table import Table
from targets import Curve, fall_after_peak, hits, reached_summary, seed_ratio, speedups, t_interval

from spotlight.queue_worker import term_with_parent
from spotlight.store import RunStore

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mode:
    name: str
    sets: list[str] = field(default_factory=list)
    data_parallel: int = 0  # > 0: a data-parallel `none` run with this many ranks (one core each)
    cores: int = 2
    what: str = ""


MODES = [
    Mode("none", ["exploration.mode=none"], cores=1, what="random seeds, 1 core"),
    Mode("none-dp2", [], data_parallel=2, what="random seeds, 2-rank data-parallel, same batch (2 cores)"),
    Mode("none-dp2-16p", ["grpo.prompts_per_iteration=16"], data_parallel=2,
         what="random seeds, 2-rank data-parallel, twice the batch: 16 prompts (2 cores)"),
    Mode("sync", ["exploration.mode=sync"], what="fresh-weight exploration on the critical path"),
    Mode("spotlight", ["exploration.mode=spotlight"], what="stale exploration, overlapped"),
    Mode("prompt-select", ["exploration.mode=spotlight", "exploration.select=prompts"],
         what="ablation: select prompts only (first G seeds)"),
    Mode("seed-select", ["exploration.mode=spotlight", "exploration.select=seeds"],
         what="ablation: select seeds only (no extra prompts)"),
]
BY_NAME = {m.name: m for m in MODES}
BASELINES = ("none", "none-dp2", "none-dp2-16p")  # the speed-up columns; the dp2 ones are compute-matched


def env() -> dict[str, str]:
    """One thread per process; Prefect's ephemeral server may take minutes to start on a loaded machine."""
    return {"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300", **os.environ, "OMP_NUM_THREADS": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}


def run_mode(mode: Mode, seed: int, iterations: int, root: Path, extra: list[str]) -> Path:
    run = root / f"{mode.name}-s{seed}"
    sets = [f"run.url=file://{run}", f"run.cache_url=file://{root}/cache", f"run.seed={seed}",
            f"grpo.iterations={iterations}", "evaluation.every=1", *extra, *mode.sets]
    if mode.data_parallel:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(mode.data_parallel), str(REPO / "bench/data_parallel_run.py"),
               "--cpus", ",".join(str(i) for i in range(mode.data_parallel)),
               *[a for s in sets for a in ("--set", s)]]
    else:
        explorers = 1 if mode.cores == 2 else 0
        sets += ["placement.trainer.local_cpus=[0]", "placement.explorer.local_cpus=[1]",
                 f"placement.explorer.workers={explorers}"]
        cmd = [str(Path(sys.executable).with_name("spotlight")), "run", "--config", str(REPO / "configs/tiny.yaml"),
               *[a for s in sets for a in ("--set", s)]]
    # the run gets SIGTERM when this process dies (even by kill -9), and stops its own workers
    subprocess.run(cmd, check=True, env=env(), stdout=subprocess.DEVNULL, preexec_fn=term_with_parent)
    return run


def committed(store: RunStore, name: str, obj: str) -> dict | None:
    """An object of a committed step, read through the store (objects live under the commit's attempt key)."""
    return store.load(name).json(obj) if store.is_committed(name) else None


@dataclass
class RunRecord:
    evals: list[float]  # held-out reward of theta_1..theta_n
    seconds: list[float]  # critical-path seconds of iterations 0..n-1
    core_seconds: list[float]  # busy core-seconds of iterations 0..n-1
    diversity: list[float | None]  # diversity vs base of theta_1..theta_n
    realisms: list[float | None]  # realism of theta_1..theta_n (digits: distance to the nearest real digits)

    @property
    def diversity_vs_base(self) -> float | None:  # of theta_n
        return self.diversity[-1]

    @property
    def realism(self) -> float | None:  # of theta_n, lower is better
        return self.realisms[-1]

    @property
    def fall(self) -> float:
        """The decline after the peak: how far the last 5 policies' held-out reward falls below the best
        reached by then (0 for a curve that never falls; a curve still rising ends with no fall)."""
        return fall_after_peak(self.evals)

    def at_first(self, target: float) -> tuple[float | None, float | None] | None:
        """Diversity and realism of the first policy that reached ``target`` (None if none did)."""
        i = next((i for i, v in enumerate(self.evals) if v >= target), None)
        return None if i is None else (self.diversity[i], self.realisms[i])

    def first(self, n: int) -> RunRecord:
        """The record of theta_1..theta_n only (a baseline run longer than the quality comparison)."""
        return RunRecord(self.evals[:n], self.seconds[:n], self.core_seconds[:n], self.diversity[:n],
                         self.realisms[:n])

    @property
    def wall(self) -> Curve:
        return self.evals, self.seconds

    @property
    def cores(self) -> Curve:
        return self.evals, self.core_seconds


def record(run: Path, iterations: int) -> RunRecord:
    """A finished run's held-out curve, critical-path seconds and busy core-seconds per iteration.

    Exploration k's worker seconds count in the iteration it ran during: k - 1 in spotlight mode
    (explore(0) in iteration 0), k in sync mode."""
    store = RunStore(f"file://{run}")
    metrics = [committed(store, f"evaluations/{t:04d}", "metrics.json") for t in range(1, iterations + 1)]
    evals = [m["eval_reward"] for m in metrics]
    timeline = [store.get_json(f"timeline/{t:04d}.json") for t in range(iterations)]
    seconds = [x["critical_path_seconds"] for x in timeline]
    core_seconds = [x["critical_path_seconds"] * x.get("trainer_processes", 1) for x in timeline]
    mode = committed(store, "config", "config.json")["exploration"]["mode"]
    for k in range(iterations + 1):
        s = committed(store, f"iterations/{k:04d}/explore", "stats.json") if mode != "none" else None
        if s is not None:
            worker = s.get("worker_rollout_seconds", s["rollout_seconds"])
            core_seconds[max(k - 1, 0) if mode == "spotlight" else min(k, iterations - 1)] += worker
    return RunRecord(evals, seconds, core_seconds, [m.get("diversity_vs_base") for m in metrics],
                     [m.get("realism_digits") for m in metrics])


def quality_goal(spotlight: list[RunRecord], baseline: list[RunRecord], iterations: int) -> str:
    """The quality goal at the last policy (means over the seeds): held-out >= 0.98, diversity >= 0.85 of
    the base's, realism no worse than none-dp2-16p's, and no decline after the peak (the last 5 policies
    within 0.005 of the run's best)."""
    reward, fall = fmean(r.evals[-1] for r in spotlight), fmean(r.fall for r in spotlight)
    diversity = fmean(r.diversity_vs_base for r in spotlight)
    realism, realism_base = fmean(r.realism for r in spotlight), fmean(r.realism for r in baseline)
    checks = [(f"held-out {reward:.3f} >= 0.98", reward >= 0.98),
              (f"diversity {diversity:.3f} >= 0.85 of the base's", diversity >= 0.85),
              (f"realism {realism:.4f} <= none-dp2-16p's {realism_base:.4f}", realism <= realism_base),
              (f"fall after the peak in the last 5 {fall:.4f} <= 0.005 (worst seed {max(r.fall for r in spotlight):.4f})",
               fall <= 0.005)]
    return f"quality goal, spotlight at theta_{iterations}: " + "; ".join(
        f"{text} {'met' if ok else 'NOT met'}" for text, ok in checks)


def iv(interval) -> str:
    """Mean [95% interval] (the seeds counted are in the "seeds reached" column)."""
    if interval is None:
        return "not reached"
    return f"{interval.mean:.1f}" if interval.low is None else \
        f"{interval.mean:.1f} [{interval.low:.1f}, {interval.high:.1f}]"


def fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def main(targets: str = "0.95,0.96,0.97,0.975,0.98", iterations: int = 20, seeds: str = "0",
         run_iterations: int = typer.Option(0, help="run the other modes this long (0: --iterations), to time a "
                                             "seed that reaches a target just after theta_ITERATIONS"),
         baseline_iterations: int = typer.Option(0, help="run the baselines this long (0: --iterations), to time "
                                                  "their way to a target they reach late; quality is still "
                                                  "compared at theta_ITERATIONS (the same weights: nothing in "
                                                  "a run depends on its length)"),
         out: Path = typer.Option(None),
         extra: list[str] = typer.Option([], "--set", help="a config override for every mode; what defines a "
                                         "mode wins (its exploration mode, none-dp2-16p's 16 prompts)"),
         modes: str = typer.Option(",".join(m.name for m in MODES), help="which modes, comma-separated"),
         quality_at: float = typer.Option(0.97, help="also show diversity and realism where a run first reaches this"),
         reuse: bool = typer.Option(False, help="print the tables for the runs already under --out; run nothing")) -> None:
    if reuse and out is None:
        raise typer.BadParameter("--reuse reads the runs of an earlier bench: give its --out")
    chosen = [BY_NAME[m] for m in modes.split(",")]
    root = out or Path(tempfile.mkdtemp(prefix="time-to-target-"))
    console = Console(width=170)
    goals = [float(x) for x in targets.split(",")]
    seed_list = [int(s) for s in seeds.split(",")]
    length = {m.name: max(iterations, baseline_iterations if m.name in BASELINES else run_iterations) for m in chosen}
    records: dict[str, list[RunRecord]] = {m.name: [] for m in chosen}  # whole runs: the time to a target
    for seed in seed_list:
        for mode in chosen:
            if not reuse:
                console.print(f"running mode {mode.name} ({length[mode.name]} iterations), seed {seed} ...")
            run = root / f"{mode.name}-s{seed}" if reuse else run_mode(mode, seed, length[mode.name], root, extra)
            records[mode.name].append(record(run, length[mode.name]))
    at_n = {name: [r.first(iterations) for r in rs] for name, rs in records.items()}  # quality at theta_n
    names = [m.name for m in chosen]
    baselines = [b for b in BASELINES if b in records]

    for mode in chosen:
        console.print(f"{mode.name:>14}: {mode.what}")
    table = Table(title=f"per iteration, and the last policy (mean of seeds {seeds}; trainer on CPU 0, the worker "
                        "or the second data-parallel rank on CPU 1)",
                  caption="diversity: within-prompt, relative to the base; realism: distance to the nearest real "
                          "digits (lower is better); last: theta_n; at first >= target: the first policy that "
                          "reached it, over the seeds that did (equal reward, so a fairer comparison of quality)")
    for col in ("mode", "cores", "critical path s/it", "busy core-s/it", "held-out reward, last",
                "fall after the peak, last 5 (worst seed)", "diversity vs base, last", "realism, last",
                f"diversity, realism at first >= {quality_at}"):
        table.add_column(col)
    for mode in chosen:
        rs = at_n[mode.name]
        div = [r.diversity_vs_base for r in rs if r.diversity_vs_base is not None]
        real = [r.realism for r in rs if r.realism is not None]
        at = [q for q in (r.at_first(quality_at) for r in rs) if q is not None and None not in q]
        at_cell = f"{fmean(q[0] for q in at):.3f}, {fmean(q[1] for q in at):.3f} ({len(at)}/{len(rs)} seeds)" if at else "n/a"
        table.add_row(mode.name, str(mode.cores), f"{fmean(fmean(r.seconds) for r in rs):.2f}",
                      f"{fmean(fmean(r.core_seconds) for r in rs):.2f}", f"{fmean(r.evals[-1] for r in rs):.3f}",
                      f"{fmean(r.fall for r in rs):.4f} ({max(r.fall for r in rs):.4f})",
                      fmt(fmean(div) if div else None), fmt(fmean(real) if real else None), at_cell)
    console.print(table)
    if "spotlight" in records and "none-dp2-16p" in records:
        console.print(quality_goal(at_n["spotlight"], at_n["none-dp2-16p"], iterations))

    lengths = ", ".join(f"{name} {n}" for name, n in length.items())
    table = Table(title=f"to a held-out reward target (iterations run: {lengths}; seeds {seeds})",
                  caption="iterations, seconds, busy core-seconds: mean [95% t-interval] over the n seeds that "
                          "reached the target. x faster: mean baseline seconds / mean mode seconds over all seeds, "
                          "a seed that did not reach it counted with its whole run: '>' a lower bound, '<' an "
                          "upper bound, '-' unknown. Per seed (paired with none-dp2, a compute-matched baseline): "
                          "the same ratio seed by seed.")
    for col in ("target", "mode", "seeds reached", "iterations", "seconds", "busy core-seconds",
                *[f"x faster than {b}" for b in baselines], *(["per seed, x vs none-dp2"] if "none-dp2" in records else [])):
        table.add_column(col, no_wrap=col in ("iterations", "seconds", "busy core-seconds"))
    for goal in goals:
        by_mode = hits({m: [r.wall for r in records[m]] for m in names}, goal)
        by_mode_cores = hits({m: [r.cores for r in records[m]] for m in names}, goal)
        summary = reached_summary(by_mode)
        ratios = {b: speedups(by_mode, b) for b in baselines}
        for name in names:
            its, secs, reached = summary[name]
            cores = t_interval([h.seconds for h in by_mode_cores[name] if h.reached])
            per_seed = ([seed_ratio(b, o) for b, o in zip(by_mode["none-dp2"], by_mode[name])]
                        if "none-dp2" in by_mode and name != "none-dp2" else [])
            table.add_row(f"{goal:.3f}", name, reached, "-" if its is None else iv(its), iv(secs), iv(cores),
                          *["" if name == b else str(ratios[b][name][0] or "-") for b in baselines],
                          *([" ".join(str(r or "-") for r in per_seed)] if "none-dp2" in records else []))
        table.add_section()
    console.print(table)
    for name in names:
        for seed, r in zip(seed_list, records[name]):
            console.print(f"held-out reward, {name} seed {seed}: " + " ".join(f"{v:.3f}" for v in r.evals))
    for name in names:  # per seed, the quality at theta_n that the first table averages
        for seed, r in zip(seed_list, at_n[name]):
            console.print(f"theta_{iterations}, {name} seed {seed}: held-out {r.evals[-1]:.4f}, diversity vs base "
                          f"{fmt(r.diversity_vs_base)}, realism {fmt(r.realism, 4)}")
    console.print(f"runs kept under {root}")


if __name__ == "__main__":
    typer.run(main)
