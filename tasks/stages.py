"""Thin Prefect tasks over the pure stage functions of :mod:`spotlight.stages`.

Tasks take the config as a plain dict (what Prefect shows as parameters) and open the run from it;
stages are idempotent, so Prefect retries are safe and results need no Prefect caching.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from spotlight import cost, stages
from spotlight.run import Run, open_run as open_library_run
from spotlight.config import config_from_dict
from spotlight.console import ProgressBars
from spotlight.report import write_report
from tasks.launcher import launcher_from_env

STAGE_TASK = dict(retries=1, retry_delay_seconds=2, cache_policy=NONE, persist_result=False)
_bars = ProgressBars()


@lru_cache(maxsize=4)
def _open(config_json: str) -> Run:
    """One Run per config per process, so policies and reward models load once."""
    return open_library_run(config_from_dict(json.loads(config_json)), _bars)


def open_run(config: dict[str, Any]) -> Run:
    return _open(json.dumps(config, sort_keys=True))


@task(name="pretrain", **STAGE_TASK)
def pretrain(config: dict[str, Any]) -> str:
    commit = stages.pretrain(open_run(config))
    return commit.name if commit is not None else "pretrained pipeline"


@task(name="explore", task_run_name="explore-it{iteration}", **STAGE_TASK)
def explore(config: dict[str, Any], iteration: int, trainer_joins: bool = False) -> float:
    """Returns the seconds this task spent (waiting for the workers, in the explore modes).
    ``trainer_joins``: the flow waits for this exploration, so its process explores too."""
    started = time.perf_counter()
    run = open_run(config)
    if not run.store.is_committed(run.key("explore", iteration)):
        explored = stages.explore(run, iteration, inline=True if trainer_joins else None)
        if "stats.json" in explored.manifest["objects"]:
            worker_seconds = explored.json("stats.json")["rollout_seconds"]
            cost.record(run.store, "explore", iteration, worker_seconds, 0.0, "local")
    return time.perf_counter() - started


@task(name="filter", task_run_name="filter-it{iteration}", **STAGE_TASK)
def filter_seeds(config: dict[str, Any], iteration: int) -> str:
    return stages.filter_seeds(open_run(config), iteration).name


@task(name="update", task_run_name="update-it{iteration}", **STAGE_TASK)
def update(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    """In-process by default; a SkyPilot managed job when SPOTLIGHT_LAUNCHER=sky (same stage, same commit)."""
    run = open_run(config)
    if not run.store.is_committed(run.key("update", iteration)):
        started = time.perf_counter()
        launcher_from_env().run_stage("update", iteration, config, local=lambda: stages.update(run, iteration))
        cost.record(run.store, "update", iteration, time.perf_counter() - started, 0.0, "local")
    return run.store.load(run.key("update", iteration)).json("metrics.json")


@task(name="ranking", task_run_name="ranking-it{iteration}", **STAGE_TASK)
def ranking(config: dict[str, Any], iteration: int) -> float:
    return stages.ranking_check(open_run(config), iteration).json("metrics.json")["spearman"]


@task(name="record-iteration", task_run_name="record-it{iteration}", **STAGE_TASK)
def record_iteration(config: dict[str, Any], iteration: int, timing: dict[str, float]) -> dict[str, Any]:
    run = open_run(config)
    stages.record_timing(run, iteration, timing)
    return stages.iteration_metrics(run, iteration)


@task(name="evaluate", task_run_name="evaluate-it{iteration}", **STAGE_TASK)
def evaluate(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    return stages.evaluate(open_run(config), iteration).json("metrics.json")


@task(name="report", cache_policy=NONE, persist_result=False)
def report(config: dict[str, Any]) -> dict[str, Any]:
    _bars.close()
    return write_report(open_run(config)).as_dict()
