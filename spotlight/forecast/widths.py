"""Exploration width as a cost lever: which candidates per prompt and how many explorers reach the target
for the fewest dollars, for a placement and a set of traces.

Iterations to the target at each width are measured (a bench of spotlight runs that differ only in
width, ``bench/width_sweep.py``); what a width costs per iteration comes from the replay. A bench width
stands for the same multiple of the group size in the real config (the filter keeps G of K candidates:
K/G is what selection buys), rounded to whole seed batches. The explorer count changes no reward: who
rolls a unit out never changes its result (the planner's budget is in forward passes, not seconds), so
it only moves time and dollars, and is a replay axis. A run whose planner allocated its candidates
unevenly (the default spotlight runs) is priced at its mean width, spread evenly: the same work.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import fmean

from spotlight.config import Config
from spotlight.forecast.curves import ToTarget, by_label, to_target
from spotlight.forecast.errors import ForecastError
from spotlight.forecast.estimate import Outcome, Scenario, setup, simulate
from spotlight.forecast.records import RunRecord
from spotlight.forecast.schedules import Spotlight
from spotlight.forecast.traces import Trace, start_offsets
from spotlight.forecast.work import iteration_work


@dataclass(frozen=True)
class WidthOption:
    """One (width, explorers) cell: its seeds' iterations and its replayed runs."""

    label: str  # the bench variant
    bench_width: float  # its mean candidates per explored prompt
    bench_group: int
    width: int  # candidates per prompt at the real config
    explorers: int
    targets: tuple[ToTarget, ...]
    outcomes: tuple[Outcome, ...]

    @property
    def all_reached(self) -> bool:
        return all(t.reached for t in self.targets)

    @property
    def dollars(self) -> float:
        return fmean(o.dollars for o in self.outcomes)

    @property
    def seconds(self) -> float:
        return fmean(o.seconds for o in self.outcomes)


def real_width(bench_width: float, bench_group: int, cfg: Config) -> int:
    """The real config's candidates per prompt at the bench's multiple of the group size, in whole batches."""
    batch, group = cfg.exploration.seeds_per_batch, cfg.grpo.group_size
    floor = -(-group // batch) * batch
    return max(floor, round(bench_width / bench_group * group / batch) * batch)


def width_options(cfg: Config, scenario: Scenario, records: list[RunRecord], traces: list[Trace],
                  explorer_counts: tuple[int, ...] = (1, 2, 4)) -> list[WidthOption]:
    """Every bench width x explorer count, replayed as Spotlight at the config's placement."""
    if cfg.exploration.mode == "none":
        raise ForecastError("the width lever needs a config that explores (exploration.mode is none)")
    schedule = Spotlight("spotlight", "spotlight", trainer_spot=cfg.placement.trainer.use_spot, explorers="placement")
    options = []
    labels = by_label([r.curve for r in records])
    for label, curves in sorted(labels.items(), key=lambda kv: fmean(c.explored or 0.0 for c in kv[1])):
        runs = [r for r in records if r.label == label]
        if any(r.width is None for r in runs):
            raise ForecastError(f"width runs {label}: {', '.join(r.curve.url for r in runs if r.width is None)} "
                                "explored nothing (no iterations/NNNN/explore/stats.json)")
        bench_width, group = fmean(r.width for r in runs), runs[0].group_size
        width = real_width(bench_width, group, cfg)
        work = iteration_work(cfg, width=width)
        targets = tuple(to_target(curves, scenario.target, scenario.horizon))
        for count in explorer_counts:
            sc = replace(scenario, explorers=count)
            outcomes = []
            for trace in traces:
                s = setup(schedule, cfg, work, sc, sc.region or trace.region)
                offsets = start_offsets(trace, sc.offsets) if (schedule.trainer_spot or s.explorers.use_spot) else [0]
                outcomes += [simulate(schedule, s, trace, o, t, sc) for t in targets for o in offsets]
            options.append(WidthOption(label, bench_width, group, width, count, targets, tuple(outcomes)))
    return options


def cheapest(options: list[WidthOption]) -> WidthOption:
    """The lowest mean $ to the target among the cells whose every seed reached it (else among all)."""
    pool = [o for o in options if o.all_reached] or options
    return min(pool, key=lambda o: (o.dollars, o.seconds))
