"""Time-to-target arithmetic for the benchmarks: first hits, speed-ups that are honest about runs
that never got there, and t-intervals over seeds.

A run that did not reach a target within its iterations has no time to target, only a bound: more
than its whole run. So a speed-up over the baseline is a number only where both runs reached the
target; where the baseline did not, its whole run gives a lower bound ("> x"), and where the
compared mode did not, an upper bound ("< x"). Curves are given per mode as a list over seeds, the
same seeds in the same order for every mode, so seed i of one mode is paired with seed i of another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import fmean, stdev

from scipy.stats import t as student_t

# held-out reward of theta_1..theta_n, and the seconds of iterations 0..n-1 (theta_{i+1} exists after i+1 of them)
Curve = tuple[list[float], list[float]]


@dataclass(frozen=True)
class Hit:
    """When one run first reached a target; ``iterations``/``seconds`` are None if it never did."""

    iterations: int | None
    seconds: float | None
    run_seconds: float  # the whole run: the time to target is more than this when it was not reached

    @property
    def reached(self) -> bool:
        return self.iterations is not None

    @property
    def seconds_at_least(self) -> float:
        """The time to target if reached, else a lower bound on it (the whole run)."""
        return self.seconds if self.seconds is not None else self.run_seconds


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values with a two-sided t-interval (None below two values)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    def __str__(self) -> str:
        if self.low is None:
            return f"{self.mean:.1f} (n={self.n})"
        return f"{self.mean:.1f} [{self.low:.1f}, {self.high:.1f}] (n={self.n})"


@dataclass(frozen=True)
class Ratio:
    """How many times faster than the baseline: exact ("="), a lower bound (">") or an upper bound ("<")."""

    value: float
    relation: str

    def __str__(self) -> str:
        return f"{self.value:.2f}x" if self.relation == "=" else f"{self.relation} {self.value:.2f}x"


def first_hit(curve: Curve, target: float) -> Hit:
    """The first policy of the run whose held-out reward reaches ``target``, and the seconds to it."""
    evals, seconds = curve
    for i, value in enumerate(evals):
        if value >= target:
            return Hit(i + 1, sum(seconds[: i + 1]), sum(seconds))
    return Hit(None, None, sum(seconds))


def hits(curves: dict[str, list[Curve]], target: float) -> dict[str, list[Hit]]:
    return {mode: [first_hit(c, target) for c in runs] for mode, runs in curves.items()}


def fall_after_peak(curve: list[float], last: int = 5) -> float:
    """max over the last ``last`` points of (best so far - the point): 0 for a curve that never falls."""
    return max(max(curve[: i + 1]) - curve[i] for i in range(max(0, len(curve) - last), len(curve)))


def t_interval(values: list[float], confidence: float = 0.95) -> Interval | None:
    """Mean and t-interval of ``values`` (e.g. the seconds to target of the seeds that reached it)."""
    if not values:
        return None
    n, mean = len(values), fmean(values)
    if n < 2:
        return Interval(mean, None, None, n)
    half = student_t.ppf((1 + confidence) / 2, n - 1) * stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def seed_ratio(base: Hit, other: Hit) -> Ratio | None:
    """Baseline time over the other mode's time for one seed; None if neither reached the target."""
    if other.reached:
        return Ratio(base.seconds_at_least / other.seconds, "=" if base.reached else ">")
    if base.reached:  # the other mode needs more than its whole run: at most this much faster
        return Ratio(base.seconds / other.run_seconds, "<")
    return None


def mean_ratio(base: list[Hit], other: list[Hit]) -> Ratio | None:
    """Mean baseline time over the other mode's mean time (over all seeds), or the bound on it that the
    runs give: each seed that did not reach the target counts with its whole run, a lower bound on its
    time, so the ratio is a lower bound if only baseline seeds missed, an upper bound if only the
    other mode's did, and unknown (None) if both did."""
    base_exact, other_exact = all(h.reached for h in base), all(h.reached for h in other)
    if not (base_exact or other_exact):
        return None
    value = fmean(h.seconds_at_least for h in base) / fmean(h.seconds_at_least for h in other)
    return Ratio(value, "=" if base_exact and other_exact else ">" if other_exact else "<")


def speedups(by_mode: dict[str, list[Hit]], baseline: str) -> dict[str, tuple[Ratio | None, list[Ratio | None]]]:
    """Per mode other than ``baseline``: the ratio of mean times to target and the per-seed ratios."""
    base = by_mode[baseline]
    return {mode: (mean_ratio(base, h), [seed_ratio(b, o) for b, o in zip(base, h, strict=True)])
            for mode, h in by_mode.items() if mode != baseline}


def reached_summary(by_mode: dict[str, list[Hit]]) -> dict[str, tuple[Interval | None, Interval | None, str]]:
    """Per mode: iterations and seconds to target over the seeds that reached it, and "k/N seeds"."""
    out = {}
    for mode, h in by_mode.items():
        done = [x for x in h if x.reached]
        out[mode] = (t_interval([float(x.iterations) for x in done]), t_interval([x.seconds for x in done]),
                     f"{len(done)}/{len(h)}")
    return out
