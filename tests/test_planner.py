"""The bandit planner on synthetic prompts whose true reward spread is known: each iteration it plans,
each prompt's candidates are drawn i.i.d. with that spread, the real filter selects from them, and the
planner learns from what the filter records. It must give the high-variance prompts more candidates,
and it must not favour a prompt just because that prompt was given more candidates before."""

from __future__ import annotations

import pytest
import torch

from spotlight.filter import select
from spotlight.planner import PlannerState, PromptPosterior, gain_curve, plan

G, BATCH = 8, 8


def simulate(stds: list[float], iterations: int, seed: int, first_counts: list[int] | None = None) -> list[list[int]]:
    """Counts per iteration; rewards of prompt i ~ N(0.5, stds[i]^2); ``first_counts`` overrides iteration 0's plan."""
    prompts = [f"p{i}" for i in range(len(stds))]
    state, rewards_gen = PlannerState(), torch.Generator().manual_seed(seed)
    history = []
    for t in range(iterations):
        counts, _ = plan(state, prompts, group_size=G, batch=BATCH, budget_candidates=32 * len(prompts),
                         max_per_prompt=128, generator=torch.Generator().manual_seed(1000 * seed + t))
        if t == 0 and first_counts:
            counts = first_counts
        state.forget()  # as the run rebuilds it: one forget per iteration, then that iteration's filter rows
        for prompt, std, k in zip(prompts, stds, counts):
            rewards = (0.5 + std * torch.randn(k, generator=rewards_gen, dtype=torch.float64)).tolist()
            state.observe(prompt, select(list(range(k)), rewards, G).candidates_std, k)
        history.append(counts)
    return history


def mean_counts(runs: list[list[list[int]]], skip: int) -> list[float]:
    """Per prompt, the mean count over runs and over the iterations after the first ``skip``."""
    rows = [counts for history in runs for counts in history[skip:]]
    return [sum(col) / len(rows) for col in zip(*rows)]


def test_gain_curve_matches_the_simulated_gain_of_iid_uniform_rewards():
    """e(K) - e(G) against the mean gain of the real filter on i.i.d. uniform rewards, and the steps
    between counts (what the allocation uses); the first K of 64 draws serve every K, so steps are sharp."""
    gen, ks, reps = torch.Generator().manual_seed(0), (G, 16, 32, 64), 1000
    filtered = dict.fromkeys(ks, 0.0)
    for _ in range(reps):
        rewards = torch.rand(64, generator=gen, dtype=torch.float64).tolist()
        for k in ks:
            filtered[k] += select(list(range(k)), rewards[:k], G).std / reps
    simulated = [filtered[k] - filtered[G] for k in ks]  # ~0.10, 0.17, 0.21 at K = 16, 32, 64: grows by itself
    reference = [(gain_curve(k, G) - gain_curve(G, G)) / 12**0.5 for k in ks]
    for i in range(1, len(ks)):
        assert reference[i] == pytest.approx(simulated[i], rel=0.12)
        assert reference[i] - reference[i - 1] == pytest.approx(simulated[i] - simulated[i - 1], rel=0.12)
    curve = [gain_curve(k, G) for k in range(G, 129, BATCH)]
    steps = [b - a for a, b in zip(curve, curve[1:])]
    assert all(s > 0 for s in steps) and all(b < a for a, b in zip(steps, steps[1:])), "rising, diminishing returns"


def test_planner_gives_high_variance_prompts_more():
    stds = [0.05, 0.05, 0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    mean = mean_counts([simulate(stds, 6, seed) for seed in range(8)], skip=2)
    by_std = [(mean[i] + mean[i + 1]) / 2 for i in range(0, len(stds), 2)]
    assert all(a < b for a, b in zip(by_std, by_std[1:])), by_std
    assert by_std[-1] > 1.8 * by_std[0], by_std


def test_planner_does_not_snowball_a_prompt_given_more_candidates():
    # equal spreads, but prompt 0 got 96 candidates in the first iteration and the others 16: the old
    # gain signal (which grows with K) kept giving it twice the others' share in this very simulation
    # (55.7 vs 27.3 candidates on average)
    runs = [simulate([0.2] * 6, 6, seed, first_counts=[96, 16, 16, 16, 16, 16]) for seed in range(10)]
    mean = mean_counts(runs, skip=1)
    others = sum(mean[1:]) / 5
    assert mean[0] == pytest.approx(others, rel=0.1), mean
    assert all(c == pytest.approx(32, rel=0.1) for c in mean), "equal spreads, about equal shares"


def test_observed_spread_is_fair_at_every_count():
    """The planner's signal, the unbiased variance of all candidates, has the same mean at every K
    (the filtered group's std does not: it grows with K)."""
    gen = torch.Generator().manual_seed(1)
    for k in (8, 64):
        variances = [select(list(range(k)), (0.3 * torch.randn(k, generator=gen, dtype=torch.float64)).tolist(),
                            G).candidates_std ** 2 for _ in range(2000)]
        assert sum(variances) / len(variances) == pytest.approx(0.09, rel=0.04)


def test_posterior_forgets_old_observations():
    def after(discount: float) -> PromptPosterior:
        state = PlannerState(discount=discount)
        for std in [0.3] * 5 + [0.05] * 3:  # the spread collapses: the policy learned the prompt
            state.forget()
            state.observe("p", std, 32)
        return state.posteriors["p"]

    kept, faded = after(1.0), after(0.5)
    assert kept.mean == pytest.approx((0.04 + 31 * (5 * 0.09 + 3 * 0.0025) / 2) / (2 + 31 * 8 / 2 - 1))
    assert faded.mean < kept.mean / 3 and kept.observations == faded.observations == 8
    with pytest.raises(ValueError):
        PlannerState().observe("p", 0.1, 1)
