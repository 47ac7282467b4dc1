"""Thin Prefect tasks over the pure stage functions of :mod:`spotlight.stages`.

Tasks take the config as a plain dict (what Prefect shows as parameters) and open the run from it;
stages are idempotent, so Prefect retries are safe and results need no Prefect caching.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from spotlight import stages
from spotlight.config import config_from_dict
from spotlight.console import ProgressBars
from spotlight.report import write_report

STAGE_TASK = dict(retries=1, retry_delay_seconds=2, cache_policy=NONE, persist_result=False)
_bars = ProgressBars()


@lru_cache(maxsize=4)
def _open(config_json: str) -> stages.Run:
    """One Run per config per process, so reward models load once."""
    return stages.open_run(config_from_dict(json.loads(config_json)), _bars)


def open_run(config: dict[str, Any]) -> stages.Run:
    return _open(json.dumps(config, sort_keys=True))


@task(name="pretrain", **STAGE_TASK)
def pretrain(config: dict[str, Any]) -> str:
    return stages.pretrain(open_run(config)).name


@task(name="explore", task_run_name="explore-it{iteration}", **STAGE_TASK)
def explore(config: dict[str, Any], iteration: int) -> str:
    return stages.explore(open_run(config), iteration).name


@task(name="filter", task_run_name="filter-it{iteration}", **STAGE_TASK)
def filter_seeds(config: dict[str, Any], iteration: int) -> str:
    return stages.filter_seeds(open_run(config), iteration).name


@task(name="update", task_run_name="update-it{iteration}", **STAGE_TASK)
def update(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    return stages.update(open_run(config), iteration).json("metrics.json")


@task(name="evaluate", task_run_name="evaluate-it{iteration}", **STAGE_TASK)
def evaluate(config: dict[str, Any], iteration: int) -> dict[str, Any]:
    return stages.evaluate(open_run(config), iteration).json("metrics.json")


@task(name="report", cache_policy=NONE, persist_result=False)
def report(config: dict[str, Any]) -> dict[str, Any]:
    _bars.close()
    return write_report(open_run(config)).as_dict()
