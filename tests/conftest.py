"""Shared fixtures: a small, fast run config and a pretrained-base cache shared by the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SPOTLIGHT = str(Path(sys.executable).with_name("spotlight"))

# Small enough for seconds per iteration on one core, big enough that RL does real work.
SMALL = [
    "pretrain.steps=60", "pretrain.commit_every=20", "pretrain.classifier_steps=60",
    "grpo.iterations=3", "grpo.prompts_per_iteration=4", "grpo.group_size=4", "grpo.optimizer_steps=3",
    "evaluation.every=2", "evaluation.seeds_per_prompt=2", "sampler.train_steps=6", "sampler.eval_steps=6",
    "exploration.mode=none",
]


@pytest.fixture(scope="session")
def cache_url(tmp_path_factory) -> str:
    return f"file://{tmp_path_factory.mktemp('cache')}"


@pytest.fixture
def small_overrides(cache_url, tmp_path) -> list[str]:
    return [*SMALL, f"run.cache_url={cache_url}", f"run.url=file://{tmp_path}/run"]


def cli_env(tmp: Path) -> dict[str, str]:
    """A subprocess environment: one thread (deterministic, no oversubscription), a private Prefect home."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env.pop("PREFECT_API_URL", None)
    return env


def spotlight_cmd(*args: str, overrides: list[str]) -> list[str]:
    return [SPOTLIGHT, *args, "--config", str(REPO / "configs/tiny.yaml"), *[a for o in overrides for a in ("--set", o)]]


def run_cli(args: list[str], tmp: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=tmp, env=cli_env(tmp), capture_output=True, text=True, timeout=timeout)


#: the longest files (CPU seconds on 2 cores), started first so that `make test`'s two xdist workers
#: (``--dist loadfile``) finish together instead of one waiting on a long file picked up last
LONGEST_FIRST = ("test_real_pipelines.py", "test_pipeline.py", "test_emulated_cluster.py", "test_s3_store.py",
                 "test_prefect_deploy.py", "test_reward_runtime.py", "test_exploration.py", "test_memory.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
