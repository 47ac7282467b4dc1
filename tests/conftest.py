"""Shared fixtures: a small, fast run config and a pretrained-base cache shared by the whole session."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.prefect_server import SESSION_SERVER

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


@pytest.fixture(scope="session", autouse=True)
def prefect_api(tmp_path_factory) -> Iterator[None]:
    """One real Prefect server per test process for the ``spotlight`` runs the tests start (started by the
    first ``cli_env`` that needs it). Prefect's ephemeral API takes a random port in 8000-8999 and the first
    health answer from it, so two runs that start at once (two xdist workers) can both talk to the one server
    that bound the port first, which stops when its owner's run ends: the other run fails mid-way with
    ConnectError (as a CI run did). ``cli_env(..., ephemeral=True)`` keeps the ephemeral API where a test is
    about it (``make run`` uses it)."""
    SESSION_SERVER.home = tmp_path_factory.mktemp("prefect-api") / "home"
    yield
    SESSION_SERVER.close()


def cli_env(tmp: Path, ephemeral: bool = False) -> dict[str, str]:
    """A subprocess environment: one thread (deterministic, no oversubscription), a private Prefect home, and
    the session's Prefect server (``ephemeral``: Prefect's own temporary server, started by the run itself), and
    a temporary folder under ``tmp``, so that what a process killed with -9 cannot clean up stays in the test's."""
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(tmp / "tmp"),
               PREFECT_HOME=str(tmp / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_LOGGING_LEVEL="WARNING", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env.pop("PREFECT_API_URL", None)
    if not ephemeral:
        env["PREFECT_API_URL"] = SESSION_SERVER.api_url()
    return env


def spotlight_cmd(*args: str, overrides: list[str]) -> list[str]:
    return [SPOTLIGHT, *args, "--config", str(REPO / "configs/tiny.yaml"), *[a for o in overrides for a in ("--set", o)]]


def run_cli(args: list[str], tmp: Path, timeout: float = 600, ephemeral: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=tmp, env=cli_env(tmp, ephemeral), capture_output=True, text=True, timeout=timeout)


#: the longest files (CPU seconds on 2 cores), started first so that `make test`'s two xdist workers
#: (``--dist loadfile``) finish together instead of one waiting on a long file picked up last
LONGEST_FIRST = ("test_real_pipelines.py", "test_pipeline.py", "test_emulated_cluster.py", "test_s3_store.py",
                 "test_prefect_deploy.py", "test_reward_runtime.py", "test_exploration.py", "test_memory.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's own order is kept
