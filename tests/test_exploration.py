"""Seed exploration: the variance filter, the bandit planner, rank correlation, and a whole spotlight-mode
run whose exploration worker (a local explorer process) is killed with -9 mid-run, which must end exactly
like a run with no faults."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr

from spotlight.config import ConfigError, load_config
from spotlight.exploration import candidate_seeds, make_items, spearman
from spotlight.filter import keep_most_informative, max_variance_subset, select
from spotlight.planner import PlannerState, plan
from spotlight.store import RunStore
from tests.conftest import REPO, SMALL, cli_env, spotlight_cmd


@pytest.mark.parametrize("seed", range(20))
def test_max_variance_subset_is_optimal(seed):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(9, generator=g, dtype=torch.float64).round(decimals=1)  # ties too
    idx, std = max_variance_subset(rewards, 4)
    brute = max(rewards[list(c)].std().item() for c in itertools.combinations(range(9), 4))
    assert std == pytest.approx(brute, abs=1e-12)
    assert rewards[idx].std().item() == pytest.approx(std, abs=1e-12) and len(set(idx.tolist())) == 4


@pytest.mark.parametrize("chosen", [0, 1, 2, 3])
def test_variance_seeds_keeps_the_first_candidates_and_chooses_the_rest_optimally(chosen):
    """exploration.variance_seeds: the group keeps its first G - n candidates as drawn, and the n chosen
    among the others give the most variance any such group can have (brute force over every choice)."""
    for seed in range(10):
        rewards = torch.rand(9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).round(decimals=1)
        idx, std = max_variance_subset(rewards, 4, chosen)
        drawn = list(range(4 - chosen))
        brute = max(rewards[drawn + list(c)].std().item() for c in itertools.combinations(range(4 - chosen, 9), chosen))
        assert std == pytest.approx(brute, abs=1e-12)
        assert set(drawn) <= set(idx.tolist()) and len(set(idx.tolist())) == 4
    with pytest.raises(ConfigError, match=r"variance_seeds \(9\) exceeds grpo.group_size \(8\)"):
        load_config(REPO / "configs/tiny.yaml", ["exploration.variance_seeds=9"])


def test_variance_groups_trains_the_rest_of_the_kept_groups_on_their_drawn_seeds():
    """exploration.variance_groups: the same prompts are kept; the most varied k train their chosen seeds,
    the other kept groups their first G candidates, and the statistics report what is trained."""
    prompts, seeds = ["a", "b", "c"], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    rewards = [[0.5, 0.5, 0.0, 1.0], [0.2, 0.8, 0.5, 0.5], [0.5, 0.5, 0.1, 0.9]]
    chosen, _ = keep_most_informative(prompts, seeds, rewards, 2, 2, 0.0)
    assert chosen == {"prompts": ["a", "c"], "seeds": [[3, 4], [11, 12]]}
    mixed, stats = keep_most_informative(prompts, seeds, rewards, 2, 2, 0.0, variance_groups=1)
    assert mixed == {"prompts": ["a", "c"], "seeds": [[3, 4], [9, 10]]}  # c, the less varied, as drawn
    assert [(r["std"], r["gain"]) for r in stats["prompts"] if r["kept"]] == [
        (pytest.approx(0.5 ** 0.5), pytest.approx(0.5 ** 0.5)), (0.0, 0.0)]  # a's first two are equal
    drawn, _ = keep_most_informative(prompts, seeds, rewards, 2, 2, 0.0, variance_groups=0)
    assert drawn == {"prompts": ["a", "c"], "seeds": [[1, 2], [9, 10]]}
    with pytest.raises(ConfigError, match=r"variance_groups \(9\) exceeds grpo.prompts_per_iteration \(8\)"):
        load_config(REPO / "configs/tiny.yaml", ["exploration.variance_groups=9"])


def test_select_reports_gain_over_random_group():
    sel = select([10, 11, 12, 13, 14, 15], [0.5, 0.5, 0.5, 0.5, 0.0, 1.0], 4)
    assert sorted(sel.seeds) == [10, 11, 14, 15] or set(sel.seeds) >= {14, 15}
    assert sel.random_std == 0.0 and sel.std > 0.4


def test_ablations_select_prompts_only_or_seeds_only():
    prompts, seeds = ["a", "b", "c"], [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    rewards = [[0.5, 0.5, 0.0, 1.0], [0.0, 1.0, 0.5, 0.5], [0.4, 0.6, 0.5, 0.5]]
    both, _ = keep_most_informative(prompts, seeds, rewards, 2, 2, 0.0)
    assert both == {"prompts": ["a", "b"], "seeds": [[3, 4], [5, 6]]}  # a's best pair is not its first two
    only_prompts, _ = keep_most_informative(prompts, seeds, rewards, 2, 2, 0.0, select_seeds=False)
    assert only_prompts == {"prompts": ["b", "c"], "seeds": [[5, 6], [9, 10]]}  # ranked by the first G seeds
    cfg = load_config(REPO / "configs/tiny.yaml", ["exploration.select=seeds"])
    from spotlight.prompts import iteration_prompts

    assert len(iteration_prompts(cfg, 0)) == cfg.grpo.prompts_per_iteration  # no extra prompts
    assert iteration_prompts(cfg, 0) == iteration_prompts(load_config(REPO / "configs/tiny.yaml"), 0)[:8]


def test_spearman_matches_scipy():
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        a = torch.rand(12, generator=g).round(decimals=1).tolist()
        b = (torch.tensor(a) + 0.3 * torch.rand(12, generator=g)).tolist()
        assert spearman(a, b) == pytest.approx(spearmanr(a, b).statistic, abs=1e-9)


def test_planner_respects_floor_batches_cap_and_budget_and_learns():
    state = PlannerState()
    prompts = [f"p{i}" for i in range(4)]
    for _ in range(5):
        state.forget()
        state.observe("p2", 0.4, 16)  # p2's rewards differ widely: exploring it pays off
        state.observe("p0", 0.0, 16)  # p0's rewards are all equal: nothing to find
    counts, _ = plan(state, prompts, group_size=6, batch=4, budget_candidates=80, max_per_prompt=40,
                     generator=torch.Generator().manual_seed(0))
    assert all(c >= 6 and c % 4 == 0 and c <= 40 for c in counts)
    assert sum(counts) <= 80 and sum(counts) > 80 - 4
    assert counts[2] == max(counts) and counts[0] == min(counts)
    again, _ = plan(state, prompts, group_size=6, batch=4, budget_candidates=80, max_per_prompt=40,
                    generator=torch.Generator().manual_seed(0))
    assert again == counts, "same state and seed, same plan"


def test_candidate_seeds_are_paired_across_modes():
    """Every mode's first G seeds of each of the first P prompts are the seeds mode none trains on."""
    cfg = load_config(REPO / "configs/tiny.yaml", ["run.seed=3"])
    g, p = 8, 8
    none = candidate_seeds(cfg, 5, [g] * p)
    explored = candidate_seeds(cfg, 5, [16, 64, 8, 128, 24, 8, 40, 200, 32, 16])  # P prompts + 2 extra
    assert [len(s) for s in none] == [g] * p and len(explored) == p + 2
    assert all(e[:g] == n for e, n in zip(explored, none)), "paired: same first G seeds per prompt"
    other_counts = candidate_seeds(cfg, 5, [8, 8, 8, 16, 128, 64, 64, 8, 8, 200])
    assert other_counts[7] == explored[7][:8] and other_counts[9][:16] == explored[9], \
        "a prompt's seeds do not depend on the other prompts' counts"
    assert len({s for row in explored for s in row}) == sum(map(len, explored)), "no seed repeats across prompts"
    assert candidate_seeds(cfg, 6, [g] * p) != none, "another iteration, other seeds"


def test_items_have_fixed_batches():
    items = make_items(["a", "b"], [[1, 2, 3, 4, 5], [6, 7]], batch=2)
    assert items[0]["batches"] == {"p000-b000": [1, 2], "p000-b001": [3, 4], "p000-b002": [5]}
    assert items[1]["units"] == ["p001-b000"]


def _worker_pids(run_url: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"worker --run {run_url} --kind explorer"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_spotlight_run_with_killed_worker_equals_clean_run(tmp_path: Path, cache_url):
    common = [*SMALL, f"run.cache_url={cache_url}", "exploration.mode=spotlight", "grpo.iterations=4",
              "exploration.candidates_per_prompt=12", "exploration.seeds_per_batch=4", "exploration.extra_prompts=4",
              "exploration.ranking_every=2", "placement.lease_seconds=3", "placement.stall_seconds=6"]
    clean = tmp_path / "clean"
    result = subprocess.run(spotlight_cmd("run", overrides=[*common, f"run.url=file://{clean}",
                                                            "placement.explorer.workers=0"]),
                            cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]

    faulty = tmp_path / "faulty"
    url = f"file://{faulty}"
    proc = subprocess.Popen(spotlight_cmd("run", overrides=[*common, f"run.url={url}", "placement.explorer.workers=1"]),
                            cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    killed = []

    def kill_worker_mid_exploration():
        deadline = time.monotonic() + 300
        units = faulty / "queues/explore-0002/units"
        while time.monotonic() < deadline and not killed:
            if units.exists() and any(units.rglob("p*")):
                for pid in _worker_pids(url):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.05)

    killer = threading.Thread(target=kill_worker_mid_exploration)
    killer.start()
    out, _ = proc.communicate(timeout=600)
    killer.join()
    assert proc.returncode == 0, out[-3000:]
    assert killed, "the worker must have been killed mid-exploration"
    clean_store, faulty_store = RunStore(f"file://{clean}"), RunStore(f"file://{faulty}")
    for t in range(4):
        a = clean_store.load(f"iterations/{t:04d}/explore").json("explored.json")
        b = faulty_store.load(f"iterations/{t:04d}/explore").json("explored.json")
        assert a == b, f"explored table of iteration {t} differs after the fault"
        assert a["rewards"] is not None and len(a["prompts"]) == 4 + 4, "P prompts plus extra_prompts explored"
        if t == 0:
            plan = clean_store.load("iterations/0000/explore").json("plan.json")
            assert sum(len(s) for s in a["seeds"]) == sum(plan["counts"]) >= 12 * 8, \
                "first iteration: at least candidates_per_prompt each on average"
    final = "iterations/0003/update"
    assert clean_store.load(final).read("policy.safetensors") == faulty_store.load(final).read("policy.safetensors")
    ranking = faulty_store.load("iterations/0002/ranking").json("metrics.json")
    assert ranking["stale_policy"] == 1 and ranking["fresh_policy"] == 2 and -1 <= ranking["spearman"] <= 1
    assert ranking["coarsen"] == 2 and ranking["spearman_to_training"] != ranking["spearman"]
    stats = faulty_store.load("iterations/0002/explore").json("stats.json")
    assert stats["policy_iteration"] == 1, "spotlight explores iteration t with theta_{t-1}"
