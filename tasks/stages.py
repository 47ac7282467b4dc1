"""Thin Prefect tasks over the stages of :mod:`spotlight.stages`.

Tasks take the config as a plain dict (what Prefect shows as parameters) and open the run from it.
The GPU stages (pretrain, update, evaluate, ranking) are posted on the run store's queue and run by
the pool's trainers (:mod:`spotlight.stage_queue`); the task waits for the commit and fails with the
worker's error if the attempt failed. Exploration is planned, waited for and gathered here, its units
run by the explorers (and by the trainers when the flow waits for it). Filter, timings and the report
are bookkeeping, done here: the flow's process never computes on a GPU. Stages are idempotent, so
Prefect retries are safe (a retry after a failed attempt posts a new attempt) and results need no
Prefect caching.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NONE

from spotlight import stage_queue, stages
from spotlight.run import Run, open_run as open_library_run
from spotlight.config import config_from_dict
from spotlight.console import ProgressBars
from spotlight.report import write_report

STAGE_TASK = dict(retries=1, retry_delay_seconds=2, cache_policy=NONE, persist_result=False)
_bars = ProgressBars()


@lru_cache(maxsize=4)
def _open(config_json: str) -> Run:
    """One Run per config per process (the store, the config; no model is loaded here: the workers compute)."""
    return open_library_run(config_from_dict(json.loads(config_json)), _bars, computes=False)


def open_run(config: dict[str, Any]) -> Run:
    return _open(json.dumps(config, sort_keys=True))


def run_on_trainer(config: dict[str, Any], stage: str, iteration: int) -> dict[str, Any] | None:
    """Post the stage for the trainers (idempotent) and wait for it; None if it was committed already."""
    run = open_run(config)
    if stages.is_committed(run, stage, iteration):
        return None
    request = stage_queue.post(run.store, stage, iteration, run.cfg.placement.lease_seconds)
    get_run_logger().debug("posted %s (attempt %d) for the trainers", request.name, request.attempt)
    return stage_queue.wait(request)


@task(name="pretrain", **STAGE_TASK)
def pretrain(config: dict[str, Any]) -> str:
    _bars("pretrain (on the trainer)", 0, 1)
    run_on_trainer(config, "pretrain", 0)
    _bars("pretrain (on the trainer)", 1, 1)
    run = open_run(config)
    return f"{run.base_key}/final" if run.pretrains_base else "pretrained pipeline"


@task(name="explore", task_run_name="explore-it{iteration}", **STAGE_TASK)
def explore(config: dict[str, Any], iteration: int, trainer_joins: bool = False) -> float:
    """Returns the seconds this task spent (waiting for the workers, in the explore modes).
    ``trainer_joins``: the flow waits for this exploration, so the trainers explore too; otherwise
    (spotlight: the update of the previous iteration runs meanwhile) they join once that update is
    committed."""
    started = time.perf_counter()
    run = open_run(config)
    if not run.store.is_committed(run.key("explore", iteration)):
        join: bool | str = True if trainer_joins or iteration == 0 else run.key("update", iteration - 1)
        stages.explore(run, iteration, pool=True, trainers_join=join)
    return time.perf_counter() - started


@task(name="filter", task_run_name="filter-it{iteration}", **STAGE_TASK)
def filter_seeds(config: dict[str, Any], iteration: int) -> str:
    return stages.filter_seeds(open_run(config), iteration).name


@task(name="update", task_run_name="update-it{iteration}", **STAGE_TASK)
def update(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    """Run by a trainer (a local process, or a SkyPilot job in the cloud): same stage, same commit."""
    run_on_trainer(config, "update", iteration)
    run = open_run(config)
    _bars("RL iterations", iteration + 1, run.cfg.grpo.iterations)
    return run.store.load(run.key("update", iteration)).json("metrics.json")


@task(name="ranking", task_run_name="ranking-it{iteration}", **STAGE_TASK)
def ranking(config: dict[str, Any], iteration: int) -> float:
    run_on_trainer(config, "ranking", iteration)
    run = open_run(config)
    return run.store.load(run.key("ranking", iteration)).json("metrics.json")["spearman"]


@task(name="record-iteration", task_run_name="record-it{iteration}", **STAGE_TASK)
def record_iteration(config: dict[str, Any], iteration: int, timing: dict[str, float]) -> dict[str, Any]:
    run = open_run(config)
    stages.record_timing(run, iteration, timing)
    return stages.iteration_metrics(run, iteration)


@task(name="evaluate", task_run_name="evaluate-it{iteration}", **STAGE_TASK)
def evaluate(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    run_on_trainer(config, "evaluate", iteration)
    run = open_run(config)
    return run.store.load(stages.evaluation_key(run, iteration)).json("metrics.json")


@task(name="report", cache_policy=NONE, persist_result=False)
def report(config: dict[str, Any]) -> dict[str, Any]:
    _bars.close()
    return write_report(open_run(config)).as_dict()
