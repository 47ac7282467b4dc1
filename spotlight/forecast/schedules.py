"""The schedules a forecast compares, each a frozen dataclass whose ``run`` replays the flow's order.

What ``flows/post_train.py`` does, per schedule:

* **Sync** (plain Flow-GRPO, the ``none`` curve): evaluate(0), then per iteration the update on the
  trainer; an evaluation every ``evaluation.every`` iterations, on the critical path.
* **Sync exploration** (the ``sync`` curve, the paper's other baseline): explore(t) with fresh weights on
  the critical path, trainer and explorers together (the flow lets the trainers join at once), then
  update(t).
* **Spotlight** (the ``spotlight`` curve): explore(0) as in sync. Then explore(t+1) is published when
  update(t) is posted; the explorers take its items while the trainer updates, and the trainer joins
  the queue the moment update(t) commits (``trainers_join`` = the update's key: the flow's join rule,
  which comes before the ``stall_seconds`` fallback whenever the trainer is free). Iteration t+1
  starts when both are done. The run reaches theta_k when update(k - 1) commits.

Every worker is long-lived: booted at the start, held until the target is reached (idle time is paid).
"""

from __future__ import annotations

from dataclasses import dataclass

from spotlight.forecast.replay import Exploration, ReplayWorker, run_stage


@dataclass(frozen=True)
class StageSeconds:
    """An iteration's stages in seconds on the trainer, and its explorations as queue work."""

    update: float
    evaluate: float  # 0: not modelled
    evaluate_every: int
    exploration: Exploration | None  # explore(t), t >= 1: items in explorer-seconds, factors per worker
    first_exploration: Exploration | None  # explore(0)


@dataclass(frozen=True)
class Timeline:
    """One replayed run up to theta_k: when it got there, and what the controller waited on meanwhile."""

    end: float
    exploring_seconds: float  # an exploration queue was open (the controller polls its status)
    explorations: int
    stages: int  # trainer stage attempts that committed (updates, evaluations)


def _start(trainer: ReplayWorker, s: StageSeconds) -> tuple[float, int]:
    """evaluate(0) on the trainer: the flow's first stage after the (cached) pretrain."""
    return (run_stage(trainer, 0.0, s.evaluate), 1) if s.evaluate > 0 else (0.0, 0)


def _evaluate(trainer: ReplayWorker, clock: float, it: int, k: int, s: StageSeconds) -> tuple[float, int]:
    """The evaluation after update(it), if one is due before the target's policy."""
    if s.evaluate > 0 and s.evaluate_every and (it + 1) % s.evaluate_every == 0 and it + 1 < k:
        return run_stage(trainer, clock, s.evaluate), 1
    return clock, 0


@dataclass(frozen=True)
class Schedule:
    """A way to run the recipe: which curve it learns at, and where its workers run."""

    name: str
    curve: str  # the reward curve's label: none, sync, spotlight
    trainer_spot: bool
    explorers: str | None  # None: no explorers; "spot" / "on-demand"; "placement": as placement.explorer says

    def run(self, trainer: ReplayWorker, explorers: list[ReplayWorker], k: int, s: StageSeconds) -> Timeline:
        raise NotImplementedError


@dataclass(frozen=True)
class Sync(Schedule):
    def run(self, trainer: ReplayWorker, explorers: list[ReplayWorker], k: int, s: StageSeconds) -> Timeline:
        clock, stages = _start(trainer, s)
        for it in range(k):
            clock = run_stage(trainer, clock, s.update)
            clock, evaluated = _evaluate(trainer, clock, it, k, s)
            stages += 1 + evaluated
        return Timeline(clock, 0.0, 0, stages)


@dataclass(frozen=True)
class SyncExploration(Schedule):
    def run(self, trainer: ReplayWorker, explorers: list[ReplayWorker], k: int, s: StageSeconds) -> Timeline:
        assert s.exploration is not None and s.first_exploration is not None
        workers = [*explorers, trainer]
        (clock, stages), exploring = _start(trainer, s), 0.0
        for it in range(k):
            explored = (s.first_exploration if it == 0 else s.exploration).finish(workers, clock)
            exploring += explored - clock
            clock = run_stage(trainer, explored, s.update)
            clock, evaluated = _evaluate(trainer, clock, it, k, s)
            stages += 1 + evaluated
        return Timeline(clock, exploring, k, stages)


@dataclass(frozen=True)
class Spotlight(Schedule):
    def run(self, trainer: ReplayWorker, explorers: list[ReplayWorker], k: int, s: StageSeconds) -> Timeline:
        assert s.exploration is not None and s.first_exploration is not None
        workers, me = [*explorers, trainer], len(explorers)
        clock, stages = _start(trainer, s)
        explored = s.first_exploration.finish(workers, clock)  # explore(0): nothing to overlap, all explore
        exploring, explorations, clock = explored - clock, 1, explored
        for it in range(k):
            updated = run_stage(trainer, clock, s.update)
            if it + 1 < k:  # explore(it + 1) beside update(it); the trainer joins once the update commits
                explored = s.exploration.finish(workers, clock, {me: updated})
                exploring, explorations = exploring + explored - clock, explorations + 1
            else:  # theta_k is committed: the exploration still running does not delay the target
                explored = updated
            clock, evaluated = _evaluate(trainer, max(updated, explored), it, k, s)
            stages += 1 + evaluated
        return Timeline(clock, exploring, explorations, stages)


ON_DEMAND_SYNC = Sync("on-demand sync", "none", trainer_spot=False, explorers=None)
SYNC_EXPLORATION = SyncExploration("sync exploration, on-demand", "sync", trainer_spot=False, explorers="on-demand")
SCHEDULES: tuple[Schedule, ...] = (
    ON_DEMAND_SYNC,
    Sync("all-spot sync", "none", trainer_spot=True, explorers=None),
    SYNC_EXPLORATION,
    Spotlight("spotlight, on-demand trainer", "spotlight", trainer_spot=False, explorers="placement"),
    Spotlight("spotlight, spot trainer", "spotlight", trainer_spot=True, explorers="placement"),
)
