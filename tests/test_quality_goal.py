"""bench/quality_goal.py: issue 17's goal judged over seeds from merged bench outputs, with intervals; and
bench/paired_difference.py: what one recipe changes against another, paired by seed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from statistics import fmean, stdev

from scipy.stats import t as student_t

BENCH = Path(__file__).resolve().parents[1] / "bench"


def run(rewards: list[float], diversity: float, realism: float) -> dict[str, list[float]]:
    n = len(rewards)
    return {"eval_reward": rewards, "diversity_vs_base": [diversity] * n, "realism_digits": [realism] * n}


def bench(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / script), *args, "--iterations", "3"], capture_output=True,
                          text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


def quality_goal(*args: str) -> subprocess.CompletedProcess:
    return bench("quality_goal.py", *args)


def table_rows(stdout: str) -> dict[str, list[str]]:
    return {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in stdout.splitlines() if line.startswith("│")}


def interval(values: list[float], sign: str = "") -> str:
    """The scripts' "mean [low, high]" (95% t-interval) of ``values``; ``sign="+"`` as a difference."""
    half = student_t.ppf(0.975, len(values) - 1) * stdev(values) / len(values) ** 0.5
    m = fmean(values)
    return f"{m:{sign}.4f} [{m - half:{sign}.4f}, {m + half:{sign}.4f}]"


def test_merges_inputs_under_aliases_and_judges_by_the_mean_and_at_95(tmp_path):
    ours = {0: run([0.97, 0.99, 0.98], 0.86, 0.27), 1: run([0.96, 0.98, 0.99], 0.87, 0.28),
            2: run([0.96, 0.97, 0.975], 0.84, 0.29)}
    base = {s: run([0.9, 0.92, 0.93], 0.9, r) for s, r in ((0, 0.275), (1, 0.279), (2, 0.291))}
    (tmp_path / "a.json").write_text(json.dumps({**{f"mine|{s}": r for s, r in ours.items() if s < 2},
                                                 **{f"plain|{s}": r for s, r in base.items()}}))
    (tmp_path / "b.json").write_text(json.dumps({"mine-alias|2": ours[2], "mine|1": ours[1]}))
    out = quality_goal(str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--method", "mine,mine-alias",
                       "--baseline", "plain")
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)
    # quantity: [goal, mean [interval], met by the mean, met at 95%, seeds that meet it]
    assert rows["held-out reward, theta_3"] == [">= 0.98", interval([0.98, 0.99, 0.975]), "yes", "no", "2/3"]
    assert rows["diversity vs base"] == [">= 0.85", interval([0.86, 0.87, 0.84]), "yes", "no", "2/3"]
    assert rows["fall after the peak, last 5"][1:] == [interval([0.01, 0.0, 0.0]), "yes", "no", "2/3"]
    assert rows["realism minus plain's"] == ["<= 0", interval([-0.005, 0.001, -0.001]), "yes", "no", "2/3"]
    assert "seed 2: held-out 0.9750  diversity 0.8400  fall 0.0000  realism 0.2900 vs 0.2910 (-0.0010)" in out.stdout


def test_a_seed_that_differs_between_inputs_or_is_missing_is_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"mine|0": run([0.9, 0.95, 0.99], 0.9, 0.3),
                                                 "plain|0": run([0.9, 0.9, 0.9], 0.9, 0.3)}))
    (tmp_path / "b.json").write_text(json.dumps({"mine|0": run([0.9, 0.95, 0.98], 0.9, 0.3)}))
    out = quality_goal(str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--method", "mine", "--baseline", "plain")
    assert out.returncode != 0 and "mine seed 0 differs between the inputs" in out.stderr
    out = quality_goal(str(tmp_path / "a.json"), "--method", "mine", "--baseline", "plain", "--seeds", "0,1")
    assert out.returncode != 0 and "missing [1]" in out.stderr


def test_paired_difference_is_taken_seed_by_seed_over_merged_inputs(tmp_path):
    low = {0: run([0.9, 0.95, 0.98], 0.86, 0.27), 1: run([0.9, 0.95, 0.99], 0.84, 0.28),
           2: run([0.9, 0.95, 0.97], 0.85, 0.30)}
    high = {0: run([0.9, 0.95, 0.975], 0.87, 0.275), 1: run([0.9, 0.95, 0.985], 0.86, 0.27),
            2: run([0.9, 0.95, 0.972], 0.86, 0.29)}
    (tmp_path / "a.json").write_text(json.dumps({f"kl18|{s}": r for s, r in low.items()}))
    (tmp_path / "b.json").write_text(json.dumps({**{f"kl21|{s}": r for s, r in high.items() if s},
                                                 "kl21-alias|0": high[0]}))
    out = bench("paired_difference.py", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--a", "kl18",
                "--b", "kl21,kl21-alias")
    assert out.returncode == 0, out.stderr
    rows = table_rows(out.stdout)

    # quantity: [a's mean, b's mean, a - b paired by seed [95% interval], seeds where a > b]
    assert rows["held-out reward"] == ["0.9800", "0.9773", interval([0.005, 0.005, -0.002], "+"), "2/3"]
    assert rows["diversity vs base"] == ["0.8500", "0.8633", interval([-0.01, -0.02, -0.01], "+"), "0/3"]
    assert rows["realism"] == ["0.2833", "0.2783", interval([-0.005, 0.01, 0.01], "+"), "2/3"]
    out = bench("paired_difference.py", str(tmp_path / "a.json"), "--a", "kl18", "--b", "kl21")
    assert out.returncode != 0 and "need >= 2 seeds run with both kl18 and kl21" in out.stderr


def small_run(root: Path, name: str, seed: int, cache_url: str, *sets: str) -> dict:
    """One iteration of the small config in a bench-style folder ``{name}-s{seed}``; theta_1's evaluation."""
    from spotlight import stages
    from spotlight.config import load_config
    from spotlight.run import open_run

    from tests.conftest import REPO, SMALL

    run = open_run(load_config(REPO / "configs/tiny.yaml", [
        *SMALL, f"run.cache_url={cache_url}", f"run.url=file://{root}/{name}-s{seed}", f"run.seed={seed}",
        "grpo.iterations=1", "evaluation.every=1", "placement.explorer.workers=0", *sets]))
    stages.pretrain(run)
    stages.update(run, 0)
    return stages.evaluate(run, 1).json("metrics.json")


def test_reevaluation_on_more_seeds_is_what_a_run_evaluating_on_them_records(tmp_path, cache_url):
    """--seeds-per-prompt re-evaluates theta_N on K seeds per held-out prompt: the same numbers a run of the
    same recipe that evaluated on K seeds itself records, its first chunk the run's own evaluation."""
    kl = "grpo.kl_beta=0.5"
    own = {(name, seed): small_run(tmp_path / "runs", name, seed, cache_url, *sets)
           for name, sets in (("mine", [kl]), ("plain", [])) for seed in (0, 1)}
    wide = small_run(tmp_path / "wide", "mine", 0, cache_url, kl, "evaluation.seeds_per_prompt=6")
    out = subprocess.run([sys.executable, str(BENCH / "quality_goal.py"), str(tmp_path / "runs"), "--method", "mine",
                          "--baseline", "plain", "--iterations", "1", "--seeds-per-prompt", "6", "--parallel", "1"],
                         capture_output=True, text=True, env={"COLUMNS": "250", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    rows = json.loads((tmp_path / "runs" / "reevaluated-6-1.json").read_text())
    assert sorted(rows) == ["mine-s0", "mine-s1", "plain-s0", "plain-s1"] and all(len(r) == 4 for r in rows.values())
    for key in ("eval_reward", "diversity_vs_base", "realism_digits"):
        assert abs(rows["mine-s0"][0][key] - wide[key]) < 1e-6, key  # all 6 seeds: the wide run's own record
        for (name, seed), metrics in own.items():
            assert abs(rows[f"{name}-s{seed}"][1][key] - metrics[key]) < 1e-6, key  # the first 2: the run's own
    assert rows["mine-s0"][2] != rows["mine-s0"][1]  # another seed set, another number: the sampling noise
    table = table_rows(out.stdout)
    gap = [rows[f"mine-s{s}"][0]["realism_digits"] - rows[f"plain-s{s}"][0]["realism_digits"] for s in (0, 1)]
    assert table["realism minus plain's"][1] == interval(gap)
    assert float(table["held-out reward"][-1]) < 1e-6  # the noise table's first chunk against the run's own
    assert f"its own evaluation: held-out {own[('mine', 1)]['eval_reward']:.4f}" in out.stdout
