"""The time-to-target arithmetic of the benchmarks (bench/targets.py): speed-ups are exact where both runs
reached the target and true bounds where one did not. Synthetic curves are run past the benchmark's
horizon, so each run's true time to target is known, then cut to the horizon the benchmark sees."""

from __future__ import annotations

import random

import pytest
from scipy.stats import t as student_t

from bench.targets import (Hit, Ratio, fall_after_peak, first_hit, hits, mean_ratio, reached_summary, seed_ratio, speedups,
                           t_interval)

HORIZON = 20  # iterations the benchmark runs


def curve_reaching(at: int, length: int = 40, seconds: float = 1.0) -> tuple[list[float], list[float]]:
    """A run whose held-out reward first reaches 0.97 after iteration ``at`` (1-based), ``length`` long."""
    return [0.9 if i + 1 < at else 0.97 for i in range(length)], [seconds] * length


def cut(c: tuple[list[float], list[float]], n: int = HORIZON) -> tuple[list[float], list[float]]:
    return c[0][:n], c[1][:n]


def old_bound(base: list[tuple[list[float], list[float]]], other: list[Hit]) -> float:
    """The formula this replaces: mean whole-run seconds of every baseline seed (including those that
    reached the target early) over the other mode's mean seconds to target."""
    return sum(sum(s) for _, s in base) / len(base) / (sum(h.seconds for h in other) / len(other))


def holds(ratio: Ratio, truth: float) -> bool:
    return {"=": truth == pytest.approx(ratio.value), ">": truth > ratio.value - 1e-12,
            "<": truth < ratio.value + 1e-12}[ratio.relation]


def test_old_formula_is_not_a_lower_bound_and_the_new_one_is():
    # baseline seed 0 reaches the target early (iteration 3), seed 1 only after the horizon (iteration 30);
    # the compared mode reaches it at iteration 2 on both seeds (1 s per iteration everywhere)
    full = {"none": [curve_reaching(3), curve_reaching(30)], "spotlight": [curve_reaching(2), curve_reaching(2)]}
    seen = {mode: [cut(c) for c in runs] for mode, runs in full.items()}
    truth, bench = hits(full, 0.97), hits(seen, 0.97)
    true_mean = (3 + 30) / 2 / 2  # 8.25x
    true_per_seed = [3 / 2, 30 / 2]  # 1.5x and 15x

    old = old_bound(seen["none"], bench["spotlight"])  # (20 + 20) / 2 / 2 = 10x, printed as "> 10x"
    assert old == pytest.approx(10.0)
    assert old > true_mean and old > true_per_seed[0], "the old '> x' exceeds the true ratio: not a bound"

    mean, per_seed = speedups(bench, "none")["spotlight"]
    assert mean == Ratio((3 + 20) / 2 / 2, ">") and holds(mean, true_mean)
    assert per_seed == [Ratio(1.5, "="), Ratio(10.0, ">")]
    assert all(holds(r, t) for r, t in zip(per_seed, true_per_seed))
    assert [h.reached for h in truth["none"]] == [True, True] and reached_summary(bench)["none"][2] == "1/2"


def test_bounds_hold_on_random_curves():
    """Noisy rising curves with random speeds, cut at the horizon: every ratio the bench prints is the
    truth ('=') or on the right side of it ('>', '<'); the old formula is wrong on some of them."""
    rng = random.Random(0)

    def run() -> tuple[list[float], list[float]]:
        rate, level, evals = rng.uniform(0.002, 0.02), 0.85, []
        for _ in range(60):
            level += rate + rng.gauss(0, 0.01)
            evals.append(level)
        return evals, [rng.uniform(1.0, 3.0) for _ in range(60)]

    checked = old_wrong = 0
    for _ in range(300):
        n = rng.randint(1, 5)
        full = {"none": [run() for _ in range(n)], "spotlight": [run() for _ in range(n)]}
        seen = {mode: [cut(c) for c in runs] for mode, runs in full.items()}
        for target in (0.9, 0.95, 0.97, 0.99):
            truth, bench = hits(full, target), hits(seen, target)
            if not all(h.reached for runs in truth.values() for h in runs):
                continue  # some run never gets there even in 60 iterations: no truth to compare with
            true_mean = sum(h.seconds for h in truth["none"]) / sum(h.seconds for h in truth["spotlight"])
            mean, per_seed = speedups(bench, "none")["spotlight"]
            if mean is not None:
                assert holds(mean, true_mean), (target, mean, true_mean)
                checked += 1
            for r, b, o in zip(per_seed, truth["none"], truth["spotlight"]):
                if r is not None:
                    assert holds(r, b.seconds / o.seconds), (target, r, b.seconds / o.seconds)
            spot = bench["spotlight"]
            if all(h.reached for h in spot) and not all(h.reached for h in bench["none"]):
                old_wrong += old_bound(seen["none"], spot) > true_mean
    assert checked > 300 and old_wrong > 10, (checked, old_wrong)


def test_all_reached_gives_exact_ratios_and_intervals():
    curves = {"none": [curve_reaching(at, HORIZON, 2.0) for at in (4, 6, 8)],
              "spotlight": [curve_reaching(at, HORIZON, 3.0) for at in (2, 2, 4)]}
    by_mode = hits(curves, 0.97)
    assert by_mode["none"][0] == Hit(4, 8.0, 40.0)
    mean, per_seed = speedups(by_mode, "none")["spotlight"]
    assert mean == Ratio(pytest.approx(12.0 / 8.0), "=")
    assert per_seed == [Ratio(pytest.approx(8 / 6), "="), Ratio(2.0, "="), Ratio(pytest.approx(16 / 12), "=")]
    its, secs, reached = reached_summary(by_mode)["none"]
    assert reached == "3/3" and its.mean == 6.0 and secs.n == 3
    low, high = student_t.interval(0.95, 2, loc=12.0, scale=4.0 / 3**0.5)  # seconds 8, 12, 16: sd 4
    assert (secs.mean, secs.low, secs.high) == pytest.approx((12.0, low, high))


def test_nothing_reached():
    never = [curve_reaching(HORIZON + 5, HORIZON)] * 2
    by_mode = hits({"none": never, "spotlight": never}, 0.97)
    assert speedups(by_mode, "none")["spotlight"] == (None, [None, None])
    assert reached_summary(by_mode)["spotlight"] == (None, None, "0/2")
    # the baseline never gets there, the mode always does: lower bounds from the baseline's whole runs
    by_mode = hits({"none": never, "spotlight": [curve_reaching(5, HORIZON)] * 2}, 0.97)
    assert speedups(by_mode, "none")["spotlight"] == (Ratio(4.0, ">"), [Ratio(4.0, ">")] * 2)


def test_mixed():
    none = [curve_reaching(10, HORIZON), curve_reaching(HORIZON + 1, HORIZON), curve_reaching(4, HORIZON)]
    sync = [curve_reaching(5, HORIZON), curve_reaching(HORIZON + 1, HORIZON), curve_reaching(HORIZON + 1, HORIZON)]
    spot = [curve_reaching(2, HORIZON), curve_reaching(5, HORIZON), curve_reaching(2, HORIZON)]
    out = speedups(hits({"none": none, "sync": sync, "spotlight": spot}, 0.97), "none")
    # spotlight always reached, none missed seed 1: a lower bound overall, exact where none reached
    assert out["spotlight"] == (Ratio((10 + 20 + 4) / 3 / 3, ">"), [Ratio(5.0, "="), Ratio(4.0, ">"), Ratio(2.0, "=")])
    # sync missed seeds 1 and 2, none missed seed 1: overall unknown; seed 2 only bounded from above
    assert out["sync"] == (None, [Ratio(2.0, "="), None, Ratio(4 / 20, "<")])
    assert str(Ratio(4.0, ">")) == "> 4.00x" and str(Ratio(0.2, "<")) == "< 0.20x" and str(Ratio(2.0, "=")) == "2.00x"


def test_first_hit_and_interval_edges():
    assert first_hit(([0.9, 0.97, 0.99], [1.0, 2.0, 4.0]), 0.97) == Hit(2, 3.0, 7.0)
    assert first_hit(([0.9, 0.96], [1.0, 2.0]), 0.97) == Hit(None, None, 3.0)
    assert t_interval([]) is None
    one = t_interval([5.0])
    assert (one.mean, one.low, one.high, one.n) == (5.0, None, None, 1) and str(one) == "5.0 (n=1)"
    assert mean_ratio([Hit(None, None, 10.0)], [Hit(2, 4.0, 8.0)]) == Ratio(2.5, ">")
    assert seed_ratio(Hit(3, 6.0, 10.0), Hit(None, None, 12.0)) == Ratio(0.5, "<")


def test_fall_after_the_peak_counts_only_the_last_points_and_their_best_so_far():
    assert fall_after_peak([0.90, 0.95, 0.97, 0.98]) == 0.0  # still rising: no fall
    assert fall_after_peak([0.99, 0.90, 0.95, 0.96, 0.97, 0.98, 0.985], last=5) == pytest.approx(0.04)  # 0.99 - 0.95
    assert fall_after_peak([0.99, 0.90, 0.95, 0.96, 0.97, 0.98, 0.985], last=2) == pytest.approx(0.01)
