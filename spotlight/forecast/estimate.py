"""The forecast: every schedule, seed, zone and trace offset replayed to the target, with its dollars.

Steps (each a pure function of what the one before returns):

1. per seed, the real iterations each curve needs (:mod:`~spotlight.forecast.curves`, the horizon);
2. per schedule and region, what its workers are and cost (:mod:`~spotlight.forecast.prices`) and what
   an iteration takes on them (:mod:`~spotlight.forecast.work`, :class:`StageSeconds`);
3. per zone and start offset, the replay (:mod:`~spotlight.forecast.schedules`) and its bill: every
   worker's held hours at its price, the controller for the whole run, the run's S3 requests
   (:mod:`~spotlight.forecast.requests`).

Deterministic: offsets are evenly spaced and nothing is drawn at random.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from spotlight.catalog import CATALOG_DIR
from spotlight.config import Config
from spotlight.forecast.boot import Boot
from spotlight.forecast.curves import Curve, Horizon, ToTarget, to_target
from spotlight.forecast.errors import ForecastError
from spotlight.forecast.prices import Offer, controller_offer, worker_offer
from spotlight.forecast.replay import Exploration, ReplayWorker
from spotlight.forecast.requests import CURRENT, Polling, usd, work_requests
from spotlight.forecast.schedules import ON_DEMAND_SYNC, SCHEDULES, Schedule, StageSeconds, Timeline
from spotlight.forecast.traces import Trace, start_offsets
from spotlight.forecast.work import IterationWork, iteration_work, relative_seconds


@dataclass(frozen=True)
class Scenario:
    """The stated inputs of a forecast (everything else comes from the config, the curves and the traces)."""

    target: float
    horizon: Horizon
    update_seconds: float  # the trainer's seconds per update at the config's batch, on its GPU
    boot: Boot
    polling: Polling = CURRENT
    offsets: int = 32
    cloud: str = "aws"
    region: str | None = None  # None: each trace zone's region
    explorers: int | None = None  # None: placement.explorer.workers

    def __post_init__(self) -> None:
        if not self.update_seconds > 0:
            raise ForecastError(f"update seconds must be > 0, got {self.update_seconds}")
        if self.offsets < 1:
            raise ForecastError(f"offsets = {self.offsets}: replay each trace from at least one start offset")
        if self.explorers is not None and self.explorers < 1:
            raise ForecastError(f"explorers = {self.explorers}: the exploring schedules need at least one explorer")


@dataclass(frozen=True)
class Setup:
    """One schedule in one region: its workers, their prices, and an iteration's seconds on them."""

    trainer: Offer
    explorers: Offer | None
    explorer_count: int
    controller: Offer
    seconds: StageSeconds
    items: int  # per exploration: the queue's items (prompts)
    units: int  # ... and units (seed batches)
    trainer_factor: float  # the trainer's seconds per explorer-second of exploration


@dataclass(frozen=True)
class Outcome:
    """One replayed run to the target."""

    seed: int
    offset: int  # the trace tick the replay started from (0 for on-demand-only schedules)
    reached: bool  # False: the seed's curve never reached the target; the run counts with the whole horizon
    iterations: int
    seconds: float
    usd: tuple[tuple[str, float], ...]  # (trainer | explorers | controller | s3, dollars)
    preemptions: int

    @property
    def dollars(self) -> float:
        return sum(v for _, v in self.usd)


@dataclass(frozen=True)
class ScheduleForecast:
    schedule: Schedule
    targets: tuple[ToTarget, ...]  # per seed; empty: no curve for it
    outcomes: dict[str, tuple[Outcome, ...]]  # zone -> per (seed, offset)
    setups: dict[str, Setup]  # zone -> its setup

    @property
    def all(self) -> list[Outcome]:
        return [o for outs in self.outcomes.values() for o in outs]


@dataclass(frozen=True)
class Forecast:
    scenario: Scenario
    config_name: str
    work: IterationWork
    curves: dict[str, list[Curve]]
    traces: tuple[Trace, ...]
    schedules: tuple[ScheduleForecast, ...]

    def schedule(self, name: str) -> ScheduleForecast:
        return next(s for s in self.schedules if s.schedule.name == name)


def stage_seconds(work: IterationWork, update_seconds: float, trainer_factor: float, explorers: int) -> StageSeconds:
    """Seconds of an iteration's stages given the trainer's seconds per update; explorations in
    explorer-seconds, the trainer (last worker) taking ``trainer_factor`` of them."""
    per_forward = update_seconds / work.update_forwards  # on the trainer
    on_explorer = per_forward / trainer_factor
    factors = [1.0] * explorers + [trainer_factor]
    return StageSeconds(update_seconds, work.evaluate_forwards * per_forward, work.evaluate_every,
                        Exploration(work.items(on_explorer), factors), Exploration(work.items(on_explorer, True), factors))


def setup(schedule: Schedule, cfg: Config, work: IterationWork, scenario: Scenario, region: str,
          catalog_dir: Path = CATALOG_DIR) -> Setup:
    """The schedule's workers in a region, priced from the placement, and its stage seconds on them."""
    pl = cfg.placement
    trainer = worker_offer("trainer", pl.trainer.accelerators, schedule.trainer_spot, scenario.cloud, region, catalog_dir)
    count = (scenario.explorers or pl.explorer.workers) if schedule.explorers else 0
    explorers, factor = None, 1.0
    if count:
        spot = pl.explorer.use_spot if schedule.explorers == "placement" else schedule.explorers == "spot"
        explorers = worker_offer("explorer", pl.explorer.accelerators, spot, scenario.cloud, region, catalog_dir)
        factor = relative_seconds(explorers.accelerator, trainer.accelerator)
    seconds = stage_seconds(work, scenario.update_seconds, factor, count)
    units = sum(len(item) for item in work.items(1.0))
    return Setup(trainer, explorers, count, controller_offer(scenario.cloud, region, catalog_dir), seconds,
                 len(work.candidates), units, factor)


def _check_fits(trace: Trace, schedule: Schedule, s: Setup, boot: float) -> None:
    """A unit of work that no capacity window can hold after its boot would never finish: refuse rather
    than loop."""
    longest = max(b - a for a, b in trace.held_runs) - boot
    needs = [s.seconds.update, s.seconds.evaluate] if schedule.trainer_spot else []
    if s.explorers is not None and s.explorers.use_spot and s.seconds.exploration is not None:
        needs.append(max(u for item in s.seconds.exploration.items for u in item))
    if needs and longest < max(needs):
        raise ForecastError(f"spot trace {trace.source}: its longest capacity window after booting is {longest:.0f} s, "
                            f"shorter than one unit of work ({max(needs):.0f} s): a run there never finishes")


def simulate(schedule: Schedule, s: Setup, trace: Trace, offset: int, target: ToTarget, scenario: Scenario) -> Outcome:
    """One run of one schedule in one zone, replaying the trace from ``offset``, and its bill."""
    boot = scenario.boot.seconds

    def worker(spot: bool) -> ReplayWorker:
        return ReplayWorker(trace.held_from(offset), boot) if spot else ReplayWorker.on_demand(boot)

    trainer = worker(schedule.trainer_spot)
    explorers = [worker(s.explorers.use_spot) for _ in range(s.explorer_count)] if s.explorers else []
    line: Timeline = schedule.run(trainer, explorers, target.iterations, s.seconds)
    end, poll = line.end, scenario.polling
    trainer_held = trainer.held_seconds(end)
    explorer_held = sum(w.held_seconds(end) for w in explorers)
    work = work_requests(line.stages, line.explorations, line.explorations * s.items, line.explorations * s.units,
                         s.items)
    waiting = [(line.exploring_seconds, poll.controller_exploring(s.items)),
               (end - line.exploring_seconds, poll.controller_on_stage),
               (trainer_held - trainer.busy, poll.trainer_idle),
               (explorer_held - sum(w.busy for w in explorers), poll.worker_idle)]
    requests = (work[0] + sum(t * r[0] for t, r in waiting), work[1] + sum(t * r[1] for t, r in waiting))
    bill = (("trainer", trainer_held / 3600 * s.trainer.usd_per_hour),
            ("explorers", explorer_held / 3600 * (s.explorers.usd_per_hour if s.explorers else 0.0)),
            ("controller", end / 3600 * s.controller.usd_per_hour), ("s3", usd(requests)))
    return Outcome(target.seed, offset, target.reached, target.iterations, end, bill,
                   sum(w.preemptions(end) for w in [trainer, *explorers]))


def forecast(cfg: Config, scenario: Scenario, curves: dict[str, list[Curve]], traces: list[Trace],
             schedules: tuple[Schedule, ...] = SCHEDULES, work: IterationWork | None = None,
             catalog_dir: Path = CATALOG_DIR) -> Forecast:
    """Every schedule whose curve is given, in every zone, from every start offset (on-demand-only
    schedules need one: no trace touches them)."""
    if ON_DEMAND_SYNC.curve not in curves:
        raise ForecastError(f"no {ON_DEMAND_SYNC.curve!r} curve: on-demand sync, the baseline, needs one")
    for label, runs in curves.items():
        for c in runs:
            base = dict(c.rewards).get(0)
            if base is not None and base >= scenario.target:
                raise ForecastError(f"target {scenario.target} is already met by the base policy in {label} seed "
                                    f"{c.seed} (theta_0: {base:.4f}): nothing to forecast")
    work = work if work is not None else iteration_work(cfg)
    out = []
    for schedule in schedules:
        if schedule.curve not in curves:
            out.append(ScheduleForecast(schedule, (), {}, {}))
            continue
        targets = tuple(to_target(curves[schedule.curve], scenario.target, scenario.horizon))
        if schedule.explorers is not None and cfg.exploration.mode == "none":
            raise ForecastError(f"{schedule.name}: the config's exploration.mode is none; forecast a config that explores")
        setups, outcomes = {}, {}
        for trace in traces:
            region = scenario.region or trace.region
            setups[trace.zone] = setup(schedule, cfg, work, scenario, region, catalog_dir)
            _check_fits(trace, schedule, setups[trace.zone], scenario.boot.seconds)
            spot = schedule.trainer_spot or (setups[trace.zone].explorers is not None
                                             and setups[trace.zone].explorers.use_spot)
            offsets = start_offsets(trace, scenario.offsets) if spot else [0]
            outcomes[trace.zone] = tuple(simulate(schedule, setups[trace.zone], trace, o, t, scenario)
                                         for t in targets for o in offsets)
        out.append(ScheduleForecast(schedule, targets, outcomes, setups))
    return Forecast(scenario, cfg.run.name, work, curves, tuple(traces), tuple(out))
