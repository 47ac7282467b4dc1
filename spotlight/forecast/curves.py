"""Reward curves per seed, and the stated horizon that maps a curve's iterations onto the real config's.

A bench curve is short (the digits bench: 20 iterations) and a real run long (the sd35m config: 1,000).
The forecast assumes learning progress scales with the run's length: iteration k of a curve of n
iterations stands for iteration ``ceil(k * N / n)`` of a run of N (theta_4 of 20 -> iteration 200 of
1,000). That assumption, not a measurement, sets how many real iterations each schedule pays for, so
the forecast prints it. Ratios between schedules do not depend on it (every curve is scaled alike);
boots, preemptions and the controller weigh less at longer runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from spotlight.forecast.errors import ForecastError


@dataclass(frozen=True)
class Curve:
    """One run's held-out reward per iteration (one seed of one mode or variant)."""

    label: str  # the run's name in its bench folder without the seed: none, sync, spotlight, w64, ...
    seed: int
    rewards: tuple[tuple[int, float], ...]  # (iteration, held-out reward of theta_iteration), ascending
    length: int  # iterations the run was set to (grpo.iterations)
    url: str = ""
    explored: float | None = None  # mean candidates per explored prompt (None: nothing explored)
    group_size: int | None = None

    @property
    def selection(self) -> float | None:
        """K/G: candidates explored per prompt over the group trained on (what seed selection chooses from)."""
        return self.explored / self.group_size if self.explored and self.group_size else None

    def iterations_to(self, target: float) -> int | None:
        """Iterations until theta_t first reaches the target (None: never, in this curve). With sparse
        evaluations it is an upper bound: an unevaluated iteration may have reached it."""
        return next((t for t, r in self.rewards if t >= 1 and r >= target), None)

    @property
    def best(self) -> tuple[int, float]:
        return max(self.rewards, key=lambda tr: (tr[1], -tr[0]))


@dataclass(frozen=True)
class Horizon:
    """Curve iteration k of ``curve_iterations`` -> iteration ceil(k x real / curve) of ``real_iterations``."""

    curve_iterations: int
    real_iterations: int

    def __post_init__(self) -> None:
        if self.curve_iterations < 1 or self.real_iterations < 1:
            raise ForecastError(f"horizon {self.curve_iterations}:{self.real_iterations}: both must be >= 1")

    def real(self, k: int) -> int:
        return math.ceil(k * self.real_iterations / self.curve_iterations - 1e-9)

    def describe(self) -> str:
        scale = self.real_iterations / self.curve_iterations
        return (f"horizon: curve iteration k of {self.curve_iterations} -> iteration ceil({scale:g} k) of "
                f"{self.real_iterations} (theta_4 -> {self.real(4)}); an assumption, not a measurement")


@dataclass(frozen=True)
class ToTarget:
    """Real iterations one seed's curve needs: ``reached`` False means it never reached the target within
    the curve, so it counts with the whole horizon (its cost is then a lower bound)."""

    seed: int
    iterations: int
    reached: bool


def to_target(curves: list[Curve], target: float, horizon: Horizon) -> list[ToTarget]:
    """Per seed, the real iterations to the target under the horizon."""
    out = []
    for curve in curves:
        if curve.length != horizon.curve_iterations:
            raise ForecastError(f"curve {curve.label} seed {curve.seed} ran {curve.length} iterations, the horizon "
                                f"maps {horizon.curve_iterations}: give curves of one length")
        k = curve.iterations_to(target)
        out.append(ToTarget(curve.seed, horizon.real(k) if k is not None else horizon.real_iterations, k is not None))
    return out


def by_label(curves: list[Curve]) -> dict[str, list[Curve]]:
    out: dict[str, list[Curve]] = {}
    for c in sorted(curves, key=lambda c: (c.label, c.seed)):
        out.setdefault(c.label, []).append(c)
    return out
