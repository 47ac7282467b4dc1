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
"""

from __future__ import annotations

import os
import time
from typing import Any

from prefect import flow, get_run_logger

from spotlight.config import load_config
from spotlight.memory_plan import fit_placement
from tasks import stages as stage_tasks
from tasks.artifacts import publish_iteration, publish_run
from tasks.launcher import SkyLauncher, launcher_from_env, on_flow_cancellation
from tasks.workers import worker_pool


@flow(name="spotlight-post-train", on_cancellation=[on_flow_cancellation])
def post_train(config_path: str = "configs/tiny.yaml", run_url: str | None = None,
               overrides: list[str] | None = None) -> dict[str, Any]:
    """Flow-GRPO post-training of the configured policy, committing every stage to the run store."""
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
    evaluations = set(stage_tasks.open_run(config).eval_iterations())  # commits the config: workers can open the run
    with worker_pool(cfg, launcher):  # trainers and explorers for the whole run, booted first
        stage_tasks.pretrain(config)
        stage_tasks.evaluate(config, 0)
        for it in range(n):
            started = time.perf_counter()
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
            timing = {"critical_path_seconds": time.perf_counter() - started, "update_seconds": update_seconds,
                      "explore_wait_seconds": explore_wait}
            if mode == "spotlight" and cfg.exploration.ranking_every and (it + 1) % cfg.exploration.ranking_every == 0 \
                    and it + 1 < n:
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
    return summary
