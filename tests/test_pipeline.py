"""The whole pipeline through the real CLI and Prefect flow: outputs, kill -9 resume, corrupt checkpoints."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from spotlight import cost
from spotlight.exploration import open_queues
from spotlight.pool import pool_done
from spotlight.run import open_run_from_url
from spotlight.stage_queue import open_requests
from spotlight.store import RunStore
from tests.conftest import SMALL, cli_env, run_cli, spotlight_cmd

FINAL = "iterations/0002/update"


@dataclass
class SmallRun:
    """One clean run of the small config: the reference the interrupted runs must equal, bit for bit."""

    tmp: Path
    root: Path
    overrides: list[str]
    result: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def small_run(tmp_path_factory, cache_url) -> SmallRun:
    tmp = tmp_path_factory.mktemp("small-run")
    overrides = [*SMALL, f"run.cache_url={cache_url}", f"run.url=file://{tmp}/run"]
    result = run_cli(spotlight_cmd("run", overrides=overrides), tmp, ephemeral=True)  # as `make run`
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return SmallRun(tmp, tmp / "run", overrides, result)


def test_run_writes_report_and_resumes_without_recomputing(small_run: SmallRun):
    run, result = small_run.root, small_run.result
    for name in ("reward_curve.png", "samples_before_after.png", "summary.json"):
        assert (run / "report" / name).stat().st_size > 1000 or name == "summary.json"
    assert "held-out reward, theta_3" in result.stdout and "samples_before_after.png" in result.stdout
    store = RunStore(f"file://{run}")
    policy = run / store.load(FINAL).key("policy.safetensors")
    policy_mtime = policy.stat().st_mtime_ns
    again = run_cli(spotlight_cmd("run", overrides=small_run.overrides), small_run.tmp)
    assert again.returncode == 0, again.stderr[-3000:]
    assert policy.stat().st_mtime_ns == policy_mtime, "committed work is not redone"
    assert store.load(FINAL).json("metrics.json")["first_log_ratio"] < 1e-4


def test_before_after_grid_names_its_columns_and_rows():
    """The report's sample grid reads without the config: each column under theta_0 / theta_N and its
    held-out reward, each row beside its prompt, wrapped; the tiles keep their pixels."""
    import numpy as np

    from spotlight.report import _grid_image, before_after_figure, figure_image

    rng = np.random.default_rng(0)
    first, last = (rng.integers(0, 256, (3, 8, 3, 32, 32), dtype=np.uint8) for _ in range(2))
    long = "a photograph of an astronaut riding a horse on the moon, highly detailed, cinematic lighting"
    fig = before_after_figure(first, last, [long, "a cup of tea", "a yellow bird"],
                              ("theta_0: held-out 0.857", "theta_20 (EMA): held-out 0.995"))
    texts = [t.get_text() for t in fig.texts]
    assert texts[:2] == ["theta_0: held-out 0.857", "theta_20 (EMA): held-out 0.995"]
    assert texts[2].replace("\n", " ") == long and texts[2].count("\n") >= 2  # wrapped, not cut
    assert texts[3:] == ["a cup of tea", "a yellow bird"]
    image = np.asarray(figure_image(fig))
    grid = np.asarray(_grid_image(first))
    top = image.shape[0] - grid.shape[0]
    assert any(np.array_equal(image[top:, x:x + grid.shape[1]], grid) for x in range(image.shape[1] - grid.shape[1]))


def _policy_bytes(run: Path) -> bytes:
    commit = RunStore(f"file://{run}").load(FINAL)
    return commit.read("policy.safetensors") + commit.read("optimizer.safetensors")


def test_budget_cap_stops_cleanly_and_a_raised_cap_resumes_bit_identically(tmp_path: Path, cache_url,
                                                                            small_run: SmallRun):
    """The trainer at $1 per second of its time, a cap of $2: its boot alone passes it, so the run stops before
    its first iteration (where it stops within a run is the forecast's business: tests/test_budget.py)."""
    run = tmp_path / "run"
    priced = [*SMALL, f"run.cache_url={cache_url}", f"run.url=file://{run}", "placement.trainer.price_per_hour=3600"]
    store = RunStore(f"file://{run}")
    capped = run_cli(spotlight_cmd("run", overrides=[*priced, "placement.max_dollars=2"]), tmp_path)
    out = " ".join(capped.stderr.split())
    assert capped.returncode == 3, capped.stdout[-3000:] + capped.stderr[-3000:]
    assert re.search(r"budget cap: stopped at the budget cap before iteration 0: placement.max_dollars is \$2.0000; "
                     r"spent \$\d+\.\d{4}, and the next iteration .* run again with a higher cap "
                     r"\(--set placement.max_dollars=...\) to continue", out), out[-3000:]
    assert "Traceback" not in capped.stderr and "iterations committed" in capped.stdout  # the report of what was done
    # clean: nothing of an iteration is committed, nothing posted is left open, the workers were told to leave
    # and did (each one's last ledger entry is its exit)
    assert not any(store.is_committed(f"iterations/{t:04d}/update") for t in range(3))
    assert store.is_committed("evaluations/0000") and not open_requests(store) and pool_done(store)
    assert not open_queues(open_run_from_url(store.url))
    last: dict[str, dict] = {}
    for e in cost.ledger(store):
        if e["stage"] != "controller" and (e["worker"] not in last or e["recorded_at"] > last[e["worker"]]["recorded_at"]):
            last[e["worker"]] = e  # (the controller's own entries meter the flow's VM, not a worker)
    assert last and all(e["outcome"] == "exit" for e in last.values()), \
        {w: (e["stage"], e["outcome"], e["recorded_at"]) for w, e in last.items()}

    # raised: it continues where it stopped and ends with the uncapped run's weights
    resumed = run_cli(spotlight_cmd("run", overrides=[*priced, "placement.max_dollars=100000"]), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _policy_bytes(run) == _policy_bytes(small_run.root)


def test_kill_9_anywhere_then_resume_is_bit_identical(tmp_path: Path, cache_url, small_run: SmallRun):
    reference = small_run.root
    # A fresh cache too, so the kill can land in pretraining as well as in any RL stage. Kill points
    # follow progress, not the clock (a fast machine would finish before a fixed delay): first
    # mid-pretraining, then after random numbers of the run's commits, each plus a random fraction
    # of a second, so the kill lands anywhere inside the next stage, mid-write included.
    killed, cache2 = tmp_path / "killed", tmp_path / "cache2"
    overrides = [*SMALL, f"run.cache_url=file://{cache2}", f"run.url=file://{killed}"]
    rng = random.Random(1234)
    total = _commits(reference)
    after = [(cache2, 2), *[(killed, n) for n in sorted(rng.sample(range(2, total - 1), 4))]]
    kills = 0
    for root, commits in after:
        proc = subprocess.Popen(spotlight_cmd("run", overrides=overrides), cwd=tmp_path, env=cli_env(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        while proc.poll() is None and _commits(root) < commits:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is not None:
            assert proc.returncode == 0
            break
        os.killpg(proc.pid, signal.SIGKILL)  # the whole machine dies: flow, Prefect's server, everything
        proc.wait()
        kills += 1
    result = run_cli(spotlight_cmd("run", overrides=overrides), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert kills >= 3, f"the test must actually kill runs (killed {kills} times)"
    assert _policy_bytes(killed) == _policy_bytes(reference)
    assert _base_bytes(tmp_path / "cache2") == _base_bytes(Path(cache_url.removeprefix("file://")))


def _commits(root: Path) -> int:
    return sum(1 for _ in root.rglob("COMMIT.json")) if root.exists() else 0


def _base_bytes(cache: Path) -> bytes:
    [final] = list(cache.glob("base-*/final"))
    return RunStore(f"file://{final.parent}").load(final.name).read("ema.safetensors")


def test_corrupt_checkpoint_fails_naming_the_object_and_loses_nothing(tmp_path: Path, small_overrides):
    result = run_cli(spotlight_cmd("run", overrides=[*small_overrides, "grpo.iterations=2"]), tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    obj = tmp_path / "run" / RunStore(f"file://{tmp_path}/run").load("iterations/0001/update").key("policy.safetensors")
    data = bytearray(obj.read_bytes())
    data[len(data) // 2] ^= 0x01
    obj.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    # resuming needs theta_2, i.e. that object: it must fail loudly, not retrain or overwrite
    result = run_cli(spotlight_cmd("stage", "update", "--iteration", "2", overrides=[*small_overrides, "grpo.iterations=2"]),
                     tmp_path)
    assert result.returncode == 2
    out = " ".join((result.stdout + result.stderr).split())
    assert "corrupt object" in out and "iterations/0001/update/policy.safetensors" in out
    assert all(p.is_file() and p.read_bytes() == data for p, data in before.items()), \
        "nothing committed is changed or removed"


def test_library_never_imports_prefect_or_sky():
    import ast
    import sys

    root = Path(__file__).resolve().parents[1] / "spotlight"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("prefect", "sky"), f"{path} imports {name}"
    modules = [f"spotlight.{'.'.join(p.relative_to(root).with_suffix('').parts)}" for p in root.rglob("*.py")
               if p.name != "__init__.py"]
    code = f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; " \
           "bad = [m for m in sys.modules if m.split('.')[0] in ('prefect', 'sky')]; assert not bad, bad"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0
