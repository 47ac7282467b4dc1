"""The post-training loop as a Prefect flow: pretrain (cached), then per iteration explore -> filter -> update.

Read it top to bottom: it is the recipe. Everything it calls is a thin task over a pure,
idempotent stage function, so re-running the flow on the same run URL resumes from the last commit.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger

from spotlight.config import load_config
from tasks import stages as t
from tasks.artifacts import publish_iteration, publish_run


@flow(name="spotlight-post-train")
def post_train(config_path: str = "configs/tiny.yaml", run_url: str | None = None,
               overrides: list[str] | None = None) -> dict[str, Any]:
    """Flow-GRPO post-training of the configured policy, committing every stage to the run store."""
    cfg = load_config(config_path, [*(overrides or []), *([f"run.url={run_url}"] if run_url else [])])
    config = cfg.model_dump(mode="json")
    log = get_run_logger()
    log.info("run %s (exploration mode %s, %d iterations)", cfg.run_url, cfg.exploration.mode, cfg.grpo.iterations)
    t.pretrain(config)
    evaluations = set(t.open_run(config).eval_iterations())
    t.evaluate(config, 0)
    for it in range(cfg.grpo.iterations):
        t.explore(config, it)
        t.filter_seeds(config, it)
        metrics = t.update(config, it)
        line = f"iteration {it}: train reward {metrics['train_reward_mean']:.3f}"
        evaluated = t.evaluate(config, it + 1) if it + 1 in evaluations else None
        if evaluated:
            line += f", held-out reward of theta_{it + 1} {evaluated['eval_reward']:.3f}"
        log.info(line)
        publish_iteration(config, it, metrics, evaluated)
    summary = t.report(config)
    publish_run(config, summary)
    return summary
