"""Forecast wall-clock and dollars to a held-out reward target by replaying real spot traces.

Three schedules (four rows: Spotlight with an on-demand and with a spot trainer):

* **on-demand sync** (the flow_grpo way): one trainer on an on-demand node runs every iteration's
  update; no seed exploration, so the run needs as many iterations as the ``none``-mode reward
  curve takes to reach the target.
* **all-spot sync**: the same curve and the same work, the trainer on a spot node.
* **Spotlight**: a trainer (on-demand or spot) plus ``explorers`` spot nodes, on the
  ``spotlight``-mode curve. explore(0) has nothing to overlap with: the explorers and the trainer
  explore it together. Then explore(t+1) runs on the explorers while update(t) runs on the trainer.
  Iteration t+1 starts when both are done, so the critical path is max(update, exploration), as in
  ``flows/post_train.py``. An explorer preemption slows the exploration. It stalls the trainer only
  when the exploration outlasts the update. The flow's stall fallback is modelled too: when the
  update is over and the explorers have made no progress for ``stall_seconds`` (all of them down),
  the trainer joins the exploration. The real fallback may start during the update as well. On a
  GPU trainer that would share the GPU with the update, and the model leaves it out.

The replay, per spot worker:

* A trace tick with a value > 0 means capacity is held. A drop to 0 is a preemption. The worker
  stays down while the trace stays at 0.
* Every spot worker of a zone replays that zone's trace from the same start offset. They are
  preempted together, the correlated case. The trace wraps around at its end.
* Each time a worker gets capacity, it pays a boot before it can work: ``cold_start_seconds`` the
  first time, ``recovery_seconds`` after each preemption. Both include provisioning, setup and
  model load.
* Work comes in units: an update, or a seed batch of an exploration (the exploration's
  worker-seconds split evenly over its batches). The project commits every stage and every batch,
  so a preemption loses only the unit in flight, from its start.
* The exploration is a pull-based queue. A free, booted explorer takes the next unit. A preempted
  unit returns to the queue at the moment of the preemption (the real queue waits for the lease
  to expire, up to ``placement.lease_seconds``; the model does not).
* Dollars accrue for every second a worker holds an instance (boots and idle waits included):
  spot workers at the spot price while held, the on-demand trainer for the whole run. Workers are
  long-lived: they are held until the target is reached.

Deterministic: start offsets are evenly spaced over each trace, and nothing is drawn at random, so the
same inputs give the same numbers. Prices come from the shipped SkyPilot catalog (``sky/catalog/v8``),
read through :mod:`spotlight.catalog` (see ``node_price`` for which row). Stage times come from a run store's
records or from the command line. The reward curves are read from run stores.
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from itertools import count
from pathlib import Path
from typing import Iterator

import numpy as np
from rich.table import Table

from spotlight.catalog import CATALOG_DIR, CatalogError, Price, node_price
from spotlight.config import ConfigError
from spotlight.store import RunStore, StoreError

REPO = Path(__file__).resolve().parent.parent
TRACES_DIR = REPO / "sky" / "traces" / "aws-v100-1node-2023-04-22"
MODES = ("none", "spotlight")  # the reward curves the schedules need: plain Flow-GRPO, and Spotlight
SCHEDULES = (  # (name, reward-curve mode, trainer on spot, explorers)
    ("on-demand sync", "none", False, False),
    ("all-spot sync", "none", True, False),
    ("spotlight, on-demand trainer", "spotlight", False, True),
    ("spotlight, spot trainer", "spotlight", True, True),
)
BASELINE = SCHEDULES[0][0]


class SimulationError(ConfigError):
    """Bad simulation input (trace, catalog, curve, parameter); the message names it."""


# -- spot traces --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Trace:
    """One zone's capacity over time: ``values[i]`` instances held during tick i."""

    zone: str
    path: Path
    gap_seconds: int
    values: tuple[int, ...]

    @property
    def region(self) -> str:
        """The zone's region (``us-east-1c`` -> ``us-east-1``): where its prices are read."""
        return re.sub(r"-?[a-z]$", "", self.zone)

    @property
    def period(self) -> int:
        return len(self.values) * self.gap_seconds

    @cached_property
    def held_runs(self) -> tuple[tuple[int, int], ...]:
        """The held intervals of one pass over the trace, in seconds from its first tick."""
        runs, start = [], None
        for i, v in enumerate(self.values + (0,)):
            if v > 0 and start is None:
                start = i
            elif v == 0 and start is not None:
                runs.append((start * self.gap_seconds, i * self.gap_seconds))
                start = None
        return tuple(runs)

    @property
    def preemptions(self) -> int:
        """Drops from held to 0 within the file."""
        return sum(1 for a, b in zip(self.values, self.values[1:]) if a > 0 and b == 0)

    def held_from(self, offset: int) -> Iterator[tuple[float, float]]:
        """Held intervals in simulated seconds, replaying from tick ``offset`` and wrapping around
        at the end (intervals that touch across the wrap are one: no preemption there)."""
        if self.held_runs == ((0, self.period),):
            yield 0.0, math.inf
            return
        shift, current = offset * self.gap_seconds, None
        for cycle in count():
            for a, b in self.held_runs:
                a, b = a + cycle * self.period - shift, b + cycle * self.period - shift
                if b <= 0:
                    continue
                a = max(a, 0)
                if current is not None and current[1] == a:
                    current = (current[0], b)
                    continue
                if current is not None:
                    yield float(current[0]), float(current[1])
                current = (a, b)


def load_trace(path: Path) -> Trace:
    """Read and check one trace file (``{"metadata": {"gap_seconds": N}, "data": [ints]}``)."""
    where = f"spot trace {path}"
    if not path.is_file():
        raise SimulationError(f"{where}: no such file")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SimulationError(f"{where}: not valid JSON ({e})") from None
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    if type(gap) is not int or gap <= 0:
        raise SimulationError(f"{where}: metadata.gap_seconds must be a positive integer, got {gap!r}")
    data = raw.get("data")
    if not isinstance(data, list) or not data:
        raise SimulationError(f"{where}: 'data' must be a non-empty list of integers")
    bad = next((i for i, v in enumerate(data) if type(v) is not int or v < 0), None)
    if bad is not None:
        raise SimulationError(f"{where}: data[{bad}] = {data[bad]!r} is not a non-negative integer")
    if not any(data):
        raise SimulationError(f"{where}: capacity is never held (every value is 0)")
    return Trace(zone=path.stem.split("_")[0], path=path, gap_seconds=gap, values=tuple(data))


def load_traces(directory: Path = TRACES_DIR, zones: list[str] | None = None) -> list[Trace]:
    """The traces of a folder (one ``<zone>_*.json`` per zone), all or the named zones."""
    if not directory.is_dir():
        raise SimulationError(f"spot trace folder {directory}: no such folder")
    paths = {p.stem.split("_")[0]: p for p in sorted(directory.glob("*.json"))}
    if not paths:
        raise SimulationError(f"spot trace folder {directory}: no *.json trace files")
    unknown = [z for z in zones or [] if z not in paths]
    if unknown:
        raise SimulationError(f"no spot trace for zone(s) {', '.join(unknown)} in {directory}; "
                              f"zones there: {', '.join(paths)}")
    return [load_trace(paths[z]) for z in (zones or list(paths))]


# -- prices ----------------------------------------------------------------------------------------
def catalog_price(accelerator: str, cloud: str, region: str, catalog_dir: Path = CATALOG_DIR) -> Price:
    """A node's on-demand and spot price (:func:`spotlight.catalog.node_price`), as a forecast input error."""
    try:
        return node_price(accelerator, cloud, region, catalog_dir)
    except CatalogError as e:
        raise SimulationError(str(e)) from None


# -- what real runs recorded ------------------------------------------------------------------
@dataclass(frozen=True)
class RunRecord:
    """What the forecast needs from one run store."""

    mode: str
    url: str
    rewards: dict[int, float]  # iteration -> held-out reward of theta_iteration
    trainer_seconds: tuple[float, ...]  # per iteration: critical path minus waits for exploration
    explore_worker_seconds: tuple[float, ...]  # per exploration: rollout seconds summed over workers
    explore_units: tuple[int, ...]  # per exploration: seed batches on its queue


def read_run(mode: str, url: str) -> RunRecord:
    """Held-out rewards (``evaluations/NNNN``), trainer seconds (``timeline/``), exploration
    worker-seconds (``iterations/NNNN/explore/stats.json``) and exploration batches
    (``queues/explore-NNNN/items``) of one run store."""
    if mode not in MODES:
        raise SimulationError(f"run {url}: mode {mode!r} is not one the schedules use ({', '.join(MODES)})")
    try:
        store = RunStore(url)
        rewards = {int(n): float(store.load(f"evaluations/{n}").json("metrics.json")["eval_reward"])
                   for n in store.list("evaluations") if n.isdigit() and store.is_committed(f"evaluations/{n}")}
        timeline = [store.get_json(f"timeline/{n}") for n in store.list("timeline") if n.endswith(".json")]
        explores = [store.load(f"iterations/{n}/explore") for n in store.list("iterations")
                    if store.is_committed(f"iterations/{n}/explore")]
        explored = [c.json("stats.json")["rollout_seconds"] for c in explores if "stats.json" in c.manifest["objects"]]
        trainer = [t["critical_path_seconds"] - t["explore_wait_seconds"] for t in timeline]
        units = [sum(len(item["units"]) for item in store.load(f"queues/{n}/items").json("items.json"))
                 for n in store.list("queues") if store.is_committed(f"queues/{n}/items")]
    except (StoreError, KeyError, ValueError, TypeError) as e:
        raise SimulationError(f"run store {url} ({mode}): unreadable record: {e!r}") from None
    if not rewards:
        raise SimulationError(f"run store {url} ({mode}): no committed evaluations (evaluations/NNNN/metrics.json)")
    return RunRecord(mode, url, rewards, tuple(trainer), tuple(float(s) for s in explored), tuple(units))


def runs_in(folder: Path) -> list[RunRecord]:
    """The run stores a ``bench/time_to_target.py --out`` folder holds (``<mode>-s<seed>``)."""
    if not folder.is_dir():
        raise SimulationError(f"curves folder {folder}: no such folder")
    found = [read_run(p.name.split("-s")[0], f"file://{p.resolve()}") for p in sorted(folder.iterdir())
             if re.fullmatch(r"[a-z]+-s\d+", p.name) and p.name.split("-s")[0] in MODES]
    if not found:
        raise SimulationError(f"curves folder {folder}: no run stores named none-s<seed> or spotlight-s<seed>")
    return found


@dataclass(frozen=True)
class Curve:
    """A mode's held-out reward per iteration: the mean over its runs (seeds)."""

    mode: str
    rewards: tuple[tuple[int, float], ...]
    runs: tuple[str, ...]

    def iterations_to(self, target: float) -> int | None:
        """Iterations until theta_t first reaches the target (None: never, in this curve). With
        sparse evaluations it is an upper bound: an unevaluated iteration may have reached it."""
        return next((t for t, r in self.rewards if t >= 1 and r >= target), None)

    @property
    def best(self) -> tuple[int, float]:
        return max(self.rewards, key=lambda tr: (tr[1], -tr[0]))


def curves_of(records: list[RunRecord]) -> dict[str, Curve]:
    """One curve per mode, over the iterations every run of the mode evaluated."""
    out = {}
    for mode in MODES:
        runs = [r for r in records if r.mode == mode]
        if not runs:
            raise SimulationError(f"no run store for mode {mode!r} (give --curves DIR or --run {mode}=URL)")
        shared = sorted(set.intersection(*(set(r.rewards) for r in runs)))
        if not shared:
            raise SimulationError(f"runs of mode {mode!r} share no evaluated iteration: "
                                  + ", ".join(r.url for r in runs))
        out[mode] = Curve(mode, tuple((t, float(np.mean([r.rewards[t] for r in runs]))) for t in shared),
                          tuple(r.url for r in runs))
    return out


@dataclass(frozen=True)
class StageTimes:
    """Seconds of work per iteration, and where each number comes from."""

    trainer_seconds: dict[str, float]  # per mode: the trainer's own critical path (filter + update)
    explore_seconds: float  # one exploration, in worker-seconds (one explorer alone would take this long)
    explore_units: int  # the batches it is cut into: the most work a preempted explorer loses is one
    sources: dict[str, str]


def stage_times(records: list[RunRecord], update_seconds: float | None = None, explore_seconds: float | None = None,
                explore_units: int | None = None) -> StageTimes:
    """Given values win; otherwise the mean of what the runs recorded."""
    trainer, sources = {}, {}
    for mode in MODES:
        if update_seconds is not None:
            trainer[mode], sources[f"update ({mode})"] = update_seconds, "given"
            continue
        measured = [s for r in records if r.mode == mode for s in r.trainer_seconds]
        if not measured:
            raise SimulationError(f"no timeline/ records in the {mode!r} runs: give --update-seconds")
        trainer[mode] = float(np.mean(measured))
        sources[f"update ({mode})"] = f"mean of {len(measured)} iterations' timeline/ (critical path - exploration wait)"
    if explore_seconds is None:
        measured = [s for r in records if r.mode == "spotlight" for s in r.explore_worker_seconds]
        if not measured:
            raise SimulationError("no iterations/NNNN/explore/stats.json in the 'spotlight' runs: give --explore-seconds")
        explore_seconds = float(np.mean(measured))
        sources["exploration"] = f"mean rollout_seconds of {len(measured)} explorations' stats.json"
    else:
        sources["exploration"] = "given"
    if explore_units is None:
        measured = [n for r in records if r.mode == "spotlight" for n in r.explore_units]
        if not measured:
            raise SimulationError("no queues/explore-NNNN/items in the 'spotlight' runs: give --explore-units")
        explore_units = round(float(np.mean(measured)))
        sources["batches"] = f"mean of {len(measured)} exploration queues"
    else:
        sources["batches"] = "given"
    for what, s in [*((f"update ({m})", v) for m, v in trainer.items()), ("exploration", explore_seconds)]:
        if not s > 0:
            raise SimulationError(f"{what} seconds must be > 0, got {s}")
    if explore_units < 1:
        raise SimulationError(f"explore units = {explore_units}: an exploration has at least one batch")
    return StageTimes(trainer, explore_seconds, explore_units, sources)


# -- the replay -----------------------------------------------------------------------------------
class ReplayWorker:
    """One worker's held and warm (booted) windows in simulated seconds, pulled lazily from its trace."""

    def __init__(self, held: Iterator[tuple[float, float]], cold_start: float, recovery: float):
        self._source, self._cold, self._recovery = held, cold_start, recovery
        self.held: list[tuple[float, float]] = []
        self._warm: list[tuple[float, float]] = []
        self._warm_ends: list[float] = []

    @classmethod
    def on_demand(cls, cold_start: float) -> "ReplayWorker":
        return cls(iter([(0.0, math.inf)]), cold_start, 0.0)

    def _cover(self, t: float) -> None:
        while not self._warm_ends or self._warm_ends[-1] <= t:
            start, end = next(self._source)
            self.held.append((start, end))
            booted = start + (self._cold if len(self.held) == 1 else self._recovery)
            if booted < end:
                self._warm.append((booted, end))
                self._warm_ends.append(end)

    def next_warm(self, t: float) -> tuple[float, float]:
        """The first moment >= t at which the worker is booted, and when that window ends."""
        self._cover(t)
        start, end = self._warm[bisect.bisect_right(self._warm_ends, t)]
        return max(start, t), end

    def held_seconds(self, until: float) -> float:
        self._cover(until)
        return sum(min(b, until) - a for a, b in self.held if a < until)

    def preemptions(self, until: float) -> int:
        self._cover(until)
        return sum(1 for _, b in self.held if b < until)


def run_units(workers: list[ReplayWorker], start: float, seconds: list[float],
              joins_at: dict[int, float] | None = None) -> list[float]:
    """Work through a queue of units from ``start``; returns when each unit was done, in order.

    Whichever worker is booted and free first takes the next unit. A preemption loses the unit in
    flight, and the unit is back on the queue at that moment. ``joins_at``: worker index -> the
    moment that worker starts taking units (default: ``start``).
    """
    pending = [(start, i) for i in range(len(seconds))]  # (on the queue from, unit): a heap
    ready = sorted((w.next_warm(max(start, (joins_at or {}).get(j, start)))[0], j) for j, w in enumerate(workers))
    done: list[float] = []
    while pending:
        t, j = heapq.heappop(ready)
        queued, unit = pending[0]
        if queued > t:  # nothing to take yet: wait for it
            heapq.heappush(ready, (workers[j].next_warm(queued)[0], j))
            continue
        heapq.heappop(pending)
        window_end = workers[j].next_warm(t)[1]
        finish = t + seconds[unit]
        if finish <= window_end:
            done.append(finish)
            heapq.heappush(ready, (workers[j].next_warm(finish)[0], j))
        else:
            heapq.heappush(pending, (window_end, unit))
            heapq.heappush(ready, (workers[j].next_warm(window_end)[0], j))
    return sorted(done)


def stalled_from(start: float, done: list[float], updated: float, stall: float) -> float | None:
    """When an exploration that started at ``start`` and finishes units at ``done`` has made no
    progress for ``stall`` seconds, once the update is over (``updated``); None: it never stalls."""
    progress = [start, *done]
    for last, nxt in zip(progress, progress[1:]):
        if max(last + stall, updated) < nxt:
            return max(last + stall, updated)
    return None


def sync_run(trainer: ReplayWorker, iterations: int, update_seconds: float) -> float:
    """Seconds until the last update commits: one update after another on the trainer."""
    clock = 0.0
    for _ in range(iterations):
        clock = run_units([trainer], clock, [update_seconds])[-1]
    return clock


def explore_ahead(trainer: ReplayWorker, explorers: list[ReplayWorker], start: float, updated: float,
                  units: list[float], stall: float) -> float:
    """When explore(t+1), started with update(t) at ``start``, is done. The trainer joins it once its
    update is over and the explorers have made no progress for ``stall`` seconds (the flow's stall
    fallback). Before that moment the trainer takes no unit, so the explorers-only replay holds until then."""
    done = run_units(explorers, start, units)
    joins = stalled_from(start, done, updated, stall)
    if joins is None:
        return done[-1]
    return run_units([*explorers, trainer], start, units, {len(explorers): joins})[-1]


def spotlight_run(trainer: ReplayWorker, explorers: list[ReplayWorker], iterations: int, update_seconds: float,
                  units: list[float], stall: float) -> float:
    """Seconds until the last update commits, exploration of t+1 overlapping update t."""
    clock = run_units([trainer, *explorers], 0.0, units)[-1]  # explore(0): nothing to overlap with, the trainer joins
    for t in range(iterations):
        updated = run_units([trainer], clock, [update_seconds])[-1]
        explored = explore_ahead(trainer, explorers, clock, updated, units, stall) if t + 1 < iterations else clock
        clock = max(updated, explored)
    return clock


# -- the forecast ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scenario:
    """The parameters of a forecast."""

    target: float
    explorers: int = 1
    cold_start_seconds: float = 300.0
    recovery_seconds: float = 300.0
    stall_seconds: float = 120.0
    offsets: int = 32

    def __post_init__(self) -> None:
        if self.explorers < 1:
            raise SimulationError(f"explorers = {self.explorers}: the Spotlight schedule needs at least one explorer")
        if self.offsets < 1:
            raise SimulationError(f"offsets = {self.offsets}: replay each trace from at least one start offset")
        if min(self.cold_start_seconds, self.recovery_seconds, self.stall_seconds) < 0:
            raise SimulationError(f"cold start ({self.cold_start_seconds} s), recovery ({self.recovery_seconds} s) "
                                  f"and stall ({self.stall_seconds} s) must be >= 0")


@dataclass(frozen=True)
class ReplayOutcome:
    """One simulated run to the target."""

    seconds: float
    dollars: float
    preemptions: int


@dataclass(frozen=True)
class ScheduleForecast:
    """One schedule's runs: none when its curve never reaches the target (nothing is invented)."""

    name: str
    mode: str
    iterations: int | None  # None: the mode's curve never reaches the target
    outcomes: dict[str, tuple[ReplayOutcome, ...]]  # zone -> one per start offset


@dataclass(frozen=True)
class Forecast:
    """Everything a forecast used and found, for the tables, the plot and the tests."""

    scenario: Scenario
    times: StageTimes
    curves: dict[str, Curve]
    traces: tuple[Trace, ...]
    trainer_prices: dict[str, Price]  # zone -> price
    explorer_prices: dict[str, Price]
    schedules: tuple[ScheduleForecast, ...]

    def schedule(self, name: str) -> ScheduleForecast:
        return next(s for s in self.schedules if s.name == name)


def start_offsets(trace: Trace, n: int) -> list[int]:
    """``n`` evenly spaced start ticks over the trace."""
    return [k * len(trace.values) // n for k in range(n)]


def _check_fits(trace: Trace, scenario: Scenario, times: StageTimes) -> None:
    """A unit of work that no capacity window can hold would never finish: refuse rather than loop."""
    longest = max(b - a for a, b in trace.held_runs) - max(scenario.cold_start_seconds, scenario.recovery_seconds)
    unit = max(*times.trainer_seconds.values(), times.explore_seconds / times.explore_units)
    if longest < unit:
        raise SimulationError(f"spot trace {trace.path}: its longest capacity window after booting is {longest:.0f} s, "
                              f"shorter than one unit of work ({unit:.0f} s): a run there never finishes")


def simulate_schedule(name: str, trace: Trace, offset: int, iterations: int, scenario: Scenario,
                      times: StageTimes, trainer_price: Price, explorer_price: Price) -> ReplayOutcome:
    """One run of one schedule in one zone, replaying its trace from ``offset``."""
    _, mode, spot_trainer, with_explorers = next(s for s in SCHEDULES if s[0] == name)
    cold, recovery = scenario.cold_start_seconds, scenario.recovery_seconds
    trainer = ReplayWorker(trace.held_from(offset), cold, recovery) if spot_trainer else ReplayWorker.on_demand(cold)
    explorers = [ReplayWorker(trace.held_from(offset), cold, recovery) for _ in range(scenario.explorers)] \
        if with_explorers else []
    update = times.trainer_seconds[mode]
    if with_explorers:
        units = [times.explore_seconds / times.explore_units] * times.explore_units
        end = spotlight_run(trainer, explorers, iterations, update, units, scenario.stall_seconds)
    else:
        end = sync_run(trainer, iterations, update)
    trainer_rate = trainer_price.spot if spot_trainer else trainer_price.on_demand
    dollars = trainer.held_seconds(end) / 3600 * trainer_rate + \
        sum(w.held_seconds(end) for w in explorers) / 3600 * explorer_price.spot
    return ReplayOutcome(end, dollars, sum(w.preemptions(end) for w in [trainer, *explorers]))


def forecast(scenario: Scenario, curves: dict[str, Curve], times: StageTimes, traces: list[Trace],
             trainer_accelerator: str = "A100:8", explorer_accelerator: str | None = None, cloud: str = "aws",
             region: str | None = None, catalog_dir: Path = CATALOG_DIR) -> Forecast:
    """Every schedule in every zone, from every start offset (the on-demand baseline needs one)."""
    for mode, curve in curves.items():
        base = dict(curve.rewards).get(0)
        if base is not None and base >= scenario.target:
            raise SimulationError(f"target {scenario.target} is already met by the base policy in the {mode!r} "
                                  f"curve (theta_0: {base:.4f}): nothing to forecast")
    trainer_prices = {t.zone: catalog_price(trainer_accelerator, cloud, region or t.region, catalog_dir) for t in traces}
    explorer_prices = {t.zone: catalog_price(explorer_accelerator or trainer_accelerator, cloud, region or t.region,
                                             catalog_dir) for t in traces}
    for trace in traces:
        _check_fits(trace, scenario, times)
    schedules = []
    for name, mode, spot_trainer, _ in SCHEDULES:
        iterations = curves[mode].iterations_to(scenario.target)
        outcomes: dict[str, tuple[ReplayOutcome, ...]] = {}
        if iterations is not None:
            for trace in traces:
                offsets = start_offsets(trace, scenario.offsets) if name != BASELINE else [0]
                outcomes[trace.zone] = tuple(
                    simulate_schedule(name, trace, o, iterations, scenario, times, trainer_prices[trace.zone],
                                      explorer_prices[trace.zone]) for o in offsets)
        schedules.append(ScheduleForecast(name, mode, iterations, outcomes))
    return Forecast(scenario, times, curves, tuple(traces), trainer_prices, explorer_prices, tuple(schedules))


# -- what is shown -------------------------------------------------------------------------------
def _spread(values: list[float]) -> tuple[float, float, float, float]:
    """Mean, p10, p50, p90."""
    p10, p50, p90 = np.percentile(values, [10, 50, 90])
    return float(np.mean(values)), float(p10), float(p50), float(p90)


def _not_reached(fc: Forecast, s: ScheduleForecast) -> str:
    t, r = fc.curves[s.mode].best
    return f"not reached (best {r:.3f}, theta_{t})"


def _ratio(value: float, baseline: float | None) -> str:
    return f"{value / baseline:.2f}x" if baseline else "n/a"


def summary_table(fc: Forecast) -> Table:
    """Time and dollars to the target per schedule, pooled over zones and start offsets."""
    zones, n = len(fc.traces), fc.scenario.offsets
    table = Table(title=f"forecast to held-out reward >= {fc.scenario.target} "
                        f"({zones} zones x {n} trace start offsets; on-demand: one run per zone)")
    for col in ("schedule", "curve", "iterations", "minutes mean (p10-p90)", "x time", "$ mean (p10-p90)",
                "x $", "preemptions/run"):
        table.add_column(col, justify="left" if col in ("schedule", "curve") else "right")
    base = fc.schedule(BASELINE)
    base_all = [o for outs in base.outcomes.values() for o in outs]
    base_min = float(np.mean([o.seconds for o in base_all])) / 60 if base_all else None
    base_usd = float(np.mean([o.dollars for o in base_all])) if base_all else None
    for s in fc.schedules:
        outs = [o for zone in s.outcomes.values() for o in zone]
        if not outs:
            table.add_row(s.name, s.mode, _not_reached(fc, s), "-", "-", "-", "-", "-")
            continue
        m, p10, _, p90 = _spread([o.seconds / 60 for o in outs])
        d, d10, _, d90 = _spread([o.dollars for o in outs])
        table.add_row(s.name, s.mode, str(s.iterations), f"{m:.1f} ({p10:.1f}-{p90:.1f})", _ratio(m, base_min),
                      f"{d:.2f} ({d10:.2f}-{d90:.2f})", _ratio(d, base_usd),
                      f"{np.mean([o.preemptions for o in outs]):.2f}")
    return table


def zone_table(fc: Forecast) -> Table:
    """The spread over start offsets, per zone: p10 / p50 / p90 and the mean's ratio to on-demand sync."""
    table = Table(title=f"per zone, over {fc.scenario.offsets} trace start offsets (p10 / p50 / p90)")
    for col in ("schedule", "zone", "minutes", "$", "x time", "x $", "preemptions/run"):
        table.add_column(col, justify="left" if col in ("schedule", "zone") else "right")
    base = fc.schedule(BASELINE).outcomes
    for s in fc.schedules[1:]:
        if not s.outcomes:
            table.add_row(s.name, "all", _not_reached(fc, s), "-", "-", "-", "-")
        for zone, outs in s.outcomes.items():
            _, p10, p50, p90 = _spread([o.seconds / 60 for o in outs])
            _, d10, d50, d90 = _spread([o.dollars for o in outs])
            b = base.get(zone)
            table.add_row(s.name, zone, f"{p10:.1f} / {p50:.1f} / {p90:.1f}", f"{d10:.2f} / {d50:.2f} / {d90:.2f}",
                          _ratio(np.mean([o.seconds for o in outs]), b[0].seconds if b else None),
                          _ratio(np.mean([o.dollars for o in outs]), b[0].dollars if b else None),
                          f"{np.mean([o.preemptions for o in outs]):.2f}")
    return table


def assumptions(fc: Forecast) -> list[str]:
    """The inputs behind the numbers, one line each, printed under the tables."""
    sc, times = fc.scenario, fc.times
    lines = [f"stage seconds per iteration: {', '.join(f'{m} {s:.2f}' for m, s in times.trainer_seconds.items())} "
             f"on the trainer; exploration {times.explore_seconds:.2f} worker-seconds in {times.explore_units} batches "
             f"over {sc.explorers} explorer(s) (" + "; ".join(f"{k}: {v}" for k, v in times.sources.items()) + ")",
             f"cold start {sc.cold_start_seconds:.0f} s, recovery after a preemption {sc.recovery_seconds:.0f} s, "
             f"the trainer joins an exploration stalled for {sc.stall_seconds:.0f} s"]
    for mode, curve in fc.curves.items():
        lines.append(f"curve {mode}: mean of {len(curve.runs)} run(s), held-out reward "
                     + " ".join(f"{r:.3f}" for _, r in curve.rewards) + f" ({', '.join(curve.runs)})")
    for trace in fc.traces:
        lines.append(f"zone {trace.zone}: trace {trace.path.name} ({len(trace.values)} ticks of {trace.gap_seconds} s, "
                     f"{trace.preemptions} preemptions in the file); trainer {fc.trainer_prices[trace.zone].describe()}"
                     + ("" if fc.explorer_prices[trace.zone] == fc.trainer_prices[trace.zone]
                        else f"; explorers {fc.explorer_prices[trace.zone].describe()}"))
    return lines


def write_plot(fc: Forecast, path: Path) -> Path:
    """Reward curves with the target, and time and dollars to it per schedule and zone (boxes over offsets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    for mode, curve in fc.curves.items():
        ax.plot(*zip(*curve.rewards), marker="o", label=f"{mode} (mean of {len(curve.runs)})")
    ax.axhline(fc.scenario.target, color="k", ls="--", lw=1, label=f"target {fc.scenario.target}")
    ax.set(xlabel="iteration", ylabel="held-out reward", title="reward curves")
    ax.legend()
    zones = [t.zone for t in fc.traces]
    width = 0.8 / len(zones)
    for ax, what, unit in ((axes[1], "seconds", "minutes to target"), (axes[2], "dollars", "$ to target")):
        for i, s in enumerate(fc.schedules):
            if not s.outcomes:
                ax.text(i, 0.5, "not reached", ha="center", va="center", rotation=90, transform=ax.get_xaxis_transform())
            for k, zone in enumerate(zones):
                values = [getattr(o, what) / (60 if what == "seconds" else 1) for o in s.outcomes.get(zone, ())]
                if values:
                    box = ax.boxplot(values, positions=[i - 0.4 + width * (k + 0.5)], widths=width * 0.9,
                                     patch_artist=True, showfliers=True)
                    box["boxes"][0].set_facecolor(f"C{k}")
        ax.set_xticks(range(len(fc.schedules)), [s.name.replace(", ", ",\n") for s in fc.schedules], fontsize=8)
        ax.set(ylabel=unit, title=f"{unit} (boxes: trace start offsets)")
    axes[1].set_yscale("log")  # capacity waits stretch minutes over orders of magnitude
    axes[2].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=f"C{k}") for k in range(len(zones))], labels=zones,
                   fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
