"""The post-training loop as a Prefect flow: pretrain (cached), then per iteration explore -> filter -> update.

Read it top to bottom: it is the recipe. Everything it calls is a thin task over a pure,
idempotent stage function, so re-running the flow on the same run URL resumes from the last commit.
The GPU work runs on the run's worker pool (``tasks/workers.py``: long-lived trainers and explorers,
local processes or SkyPilot managed jobs); each task posts its stage on the run store's queue and
waits for the commit, so the Prefect UI still shows every stage of every iteration.

Exploration modes (config ``exploration.mode``):
  none       explore(t) draws G random seeds; nothing is rolled out.
  sync       explore(t) rolls out candidates with theta_t on the critical path (trainer and workers
             together), then filter, update.
  spotlight  explore(0) as in sync (nothing to overlap with yet); then explore(t+1) runs on the
             workers with theta_t while update(t) runs: off the critical path.

Where it stops early: ``placement.max_dollars`` (no iteration starts whose forecast cost would pass it:
the run ends in the state ``BudgetCapped``, naming the cap) and ``placement.flow_timeout_hours`` (the
flow run ends ``TimedOut``). Either way, and when the flow fails, crashes or is cancelled, its workers are
torn down (``tasks.workers.worker_pool`` and the ``tear_down_pool`` hook); running it again resumes.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator

from prefect import flow, get_run_logger
from prefect.states import Failed, State
from prefect.utilities.timeout import timeout

from spotlight import budget, stages
from spotlight.config import load_config
from spotlight.memory_plan import fit_placement
from spotlight.run import Run
from tasks import stages as stage_tasks
from tasks.artifacts import publish_iteration, publish_run
from tasks.launcher import SkyLauncher, launcher_from_env
from tasks.workers import tear_down_pool, worker_pool

BUDGET_CAPPED = "BudgetCapped"  # the final state's name when the run stopped at placement.max_dollars


class FlowTimeout(TimeoutError):
    """The flow run went past ``placement.flow_timeout_hours`` (Prefect records a TimeoutError as TimedOut)."""


@contextmanager
def flow_deadline(hours: float | None, started: float) -> Iterator[None]:
    """Raise FlowTimeout in the flow once ``hours`` have passed since ``started`` (time.monotonic)."""
    if hours is None:
        yield
        return
    try:
        with timeout(seconds=max(hours * 3600 - (time.monotonic() - started), 1e-3), timeout_exc_type=FlowTimeout):
            yield
    except FlowTimeout:
        raise FlowTimeout(f"the flow run went past placement.flow_timeout_hours ({hours:g} h); its workers are torn "
                          "down, and running it again resumes from the last commit") from None


@flow(name="spotlight-post-train", on_failure=[tear_down_pool], on_crashed=[tear_down_pool],
      on_cancellation=[tear_down_pool])
def post_train(config_path: str = "configs/tiny.yaml", run_url: str | None = None,
               overrides: list[str] | None = None) -> dict[str, Any] | State:
    """Flow-GRPO post-training of the configured policy, committing every stage to the run store."""
    started, since = time.monotonic(), time.time()
    cfg = load_config(config_path, overrides, run_url)
    launcher = launcher_from_env()
    log = get_run_logger()
    if isinstance(launcher, SkyLauncher):  # rented GPUs: only those that hold their worker (the memory plan)
        cfg, dropped = fit_placement(cfg)
        for line in dropped:
            log.info(line)
    elif cfg.placement.trainer.local_cpus:
        os.sched_setaffinity(0, set(cfg.placement.trainer.local_cpus))  # this process mostly waits for it
    config, mode, n = cfg.model_dump(mode="json"), cfg.exploration.mode, cfg.grpo.iterations
    log.info("run %s (exploration mode %s, %d iterations)", cfg.run_url, mode, n)
    run = stage_tasks.open_run(config)  # commits the config: workers can open the run
    evaluations = set(run.eval_iterations())
    capped = over_budget(run, first_open_iteration(run), since) if cfg.placement.max_dollars else None
    if capped is None:  # (a resume at or past its cap launches nothing)
        with worker_pool(cfg, launcher), flow_deadline(cfg.placement.flow_timeout_hours, started):
            stage_tasks.pretrain(config)
            stage_tasks.evaluate(config, 0)
            for it in range(n):
                capped = over_budget(run, it, since)
                if capped is not None:
                    break  # nothing is in flight between iterations: the workers leave holding nothing
                started_it = time.perf_counter()
                explore_wait = 0.0
                if mode != "spotlight" or it == 0:  # on the critical path (spotlight's first has nothing to
                    # overlap with): the trainer would sit idle waiting, so it explores alongside the workers
                    explore_wait = stage_tasks.explore(config, it, trainer_joins=True)
                stage_tasks.filter_seeds(config, it)
                ahead = stage_tasks.explore.submit(config, it + 1) if mode == "spotlight" and it + 1 < n else None
                update_started = time.perf_counter()
                stage_tasks.update(config, it)
                update_seconds = time.perf_counter() - update_started
                if ahead is not None:
                    wait_started = time.perf_counter()
                    ahead.result()
                    explore_wait += time.perf_counter() - wait_started  # exploration that outlasted the update
                timing = {"critical_path_seconds": time.perf_counter() - started_it, "update_seconds": update_seconds,
                          "explore_wait_seconds": explore_wait}
                if mode == "spotlight" and cfg.exploration.ranking_every and \
                        (it + 1) % cfg.exploration.ranking_every == 0 and it + 1 < n:
                    stage_tasks.ranking(config, it + 1)
                metrics = stage_tasks.record_iteration(config, it, timing)
                line = f"iteration {it}: train reward {metrics['train_reward_mean']:.3f}"
                evaluated = stage_tasks.evaluate(config, it + 1) if it + 1 in evaluations else None
                if evaluated:
                    line += f", held-out reward of theta_{it + 1} {evaluated['eval_reward']:.3f}"
                log.info(line)
                publish_iteration(config, it, metrics, evaluated)
    summary = stage_tasks.report(config)
    publish_run(config, summary)
    if capped is not None:
        log.warning(capped)
        return Failed(name=BUDGET_CAPPED, message=capped)  # the report has been written all the same
    return summary


def first_open_iteration(run: Run) -> int:
    """The first iteration whose update is not committed (updates commit in order: a binary search)."""
    low, high = 0, run.cfg.grpo.iterations
    while low < high:
        mid = (low + high) // 2
        low, high = (mid + 1, high) if stages.is_committed(run, "update", mid) else (low, mid)
    return low


def over_budget(run: Run, it: int, since: float) -> str | None:
    """The stop message if iteration ``it`` (its update not committed yet) would take the run past
    ``placement.max_dollars``; ``since``: when this flow run started (its workers' unrecorded time counts)."""
    cap = run.cfg.placement.max_dollars
    if cap is None or it >= run.cfg.grpo.iterations or stages.is_committed(run, "update", it):
        return None
    check = budget.check(run.store, cap, since)
    get_run_logger().info("budget before iteration %d: spent $%.4f, forecast $%.4f of the $%.4f cap", it,
                          check.spent, check.forecast, check.cap)
    return check.message(it) if check.stops else None
