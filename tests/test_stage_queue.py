"""Stages as work for long-lived trainers (``spotlight/stage_queue.py``), with a real trainer process.

- A stage attempt that fails is recorded with the work item: the waiting side raises the worker's error
  (its name and traceback tail), the ledger holds the attempt with its seconds, no trainer takes the
  failed attempt again, and posting again makes a new attempt.
- SIGTERM mid-stage: the trainer abandons the stage, records the attempt as preempted (with its
  seconds), releases the item and exits 143 (preempted, not done); what it had finished (pretraining's chunks) stays
  committed, and a trainer started under the same name finishes the stage from there.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from spotlight import cost, stage_queue, stages
from spotlight.config import load_config
from spotlight.queue_worker import PREEMPTED_EXIT_CODE
from spotlight.run import open_run
from tests.conftest import REPO, SMALL, SPOTLIGHT, cli_env


def _trainer(url: str, tmp: Path, worker: str = "trainer-a") -> subprocess.Popen:
    return subprocess.Popen([SPOTLIGHT, "worker", "--run", url, "--kind", "trainer", "--id", worker,
                             "--poll-seconds", "0.05", "--idle-exit", "120"], cwd=tmp, env=cli_env(tmp),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    return out


def test_a_failed_stage_attempt_is_raised_with_the_workers_error_and_is_in_the_ledger(tmp_path, cache_url):
    run = open_run(load_config(REPO / "configs/tiny.yaml", [*SMALL, f"run.cache_url={cache_url}",
                                                            f"run.url=file://{tmp_path}/run"]))
    trainer = _trainer(run.store.url, tmp_path)
    try:
        # evaluate(5) of a run that has no theta_5 (nor, maybe, a base yet): a real failure inside the stage
        request = stage_queue.post(run.store, "evaluate", 5, lease_seconds=30)
        with pytest.raises(stage_queue.StageFailed) as err:
            stage_queue.wait(request, poll_seconds=0.05, timeout_seconds=300)
        message = str(err.value)
        assert "evaluate of iteration 5 (attempt 1) failed on worker trainer-a" in message
        assert "--- the worker's traceback (tail) ---" in message and "Traceback (most recent call last)" in message
        assert err.value.record["error"].split(":")[0] in message
        # the ledger has the attempt, with its seconds, written by the worker
        entries = [e for e in cost.ledger(run.store) if e["stage"] == "evaluate"]
        assert len(entries) == 1 and entries[0]["outcome"] == "failed" and entries[0]["iteration"] == 5
        assert entries[0]["seconds"] > 0 and entries[0]["worker"] == "trainer-a" and entries[0]["kind"] == "trainer"
        assert entries[0]["price_source"] == "placement.trainer.price_per_hour"
        # a failed attempt is final: no trainer takes it again; posting again is a new attempt
        assert stage_queue.open_requests(run.store) == []
        again = stage_queue.post(run.store, "evaluate", 5, lease_seconds=30)
        assert again.attempt == 2 and stage_queue.post(run.store, "evaluate", 5, 30).attempt == 2  # idempotent
        with pytest.raises(stage_queue.StageFailed, match=r"\(attempt 2\) failed on worker trainer-a"):
            stage_queue.wait(again, poll_seconds=0.05, timeout_seconds=300)
        assert [e["outcome"] for e in cost.ledger(run.store) if e["stage"] == "evaluate"] == ["failed", "failed"]
        assert trainer.poll() is None, "a failing stage does not take the trainer down"
    finally:
        out = _stop(trainer)
    assert trainer.returncode == PREEMPTED_EXIT_CODE, out[-3000:]  # SIGTERM while the run goes on: not done
    with pytest.raises(ValueError, match="not trainer work"):
        stage_queue.post(run.store, "filter", 0, 30)


def test_sigterm_mid_stage_releases_it_and_keeps_what_is_finished(tmp_path):
    cache = tmp_path / "cache"  # a cache of its own, so pretraining runs (in 3 chunks) in this test
    run = open_run(load_config(REPO / "configs/tiny.yaml", [*SMALL, f"run.cache_url=file://{cache}",
                                                            f"run.url=file://{tmp_path}/run", "pretrain.steps=30",
                                                            "pretrain.commit_every=10", "pretrain.classifier_steps=20"]))
    request = stage_queue.post(run.store, "pretrain", 0, lease_seconds=30)
    trainer = _trainer(run.store.url, tmp_path)
    deadline = time.monotonic() + 300
    while not any(cache.glob("base-*/step-0000010/COMMIT.json")):  # the first chunk is committed
        assert trainer.poll() is None and time.monotonic() < deadline, _stop(trainer)[-3000:]
        time.sleep(0.05)
    t0 = time.monotonic()
    out = _stop(trainer)
    assert trainer.returncode == PREEMPTED_EXIT_CODE and time.monotonic() - t0 < 15, out[-3000:]
    assert not stages.is_committed(run, "pretrain", 0), "the stage was abandoned, not finished"
    assert any(cache.glob("base-*/step-0000010/COMMIT.json")), "what was finished stays committed"
    leases = run.store.list(f"{request.prefix}/leases/{request.item_id}")
    assert "000000-released" in leases, leases  # handed back: claimable at once, no lease to wait out
    [entry] = [e for e in cost.ledger(run.store) if e["stage"] == "pretrain"]
    assert entry["outcome"] == "preempted" and entry["seconds"] > 0 and entry["iteration"] is None

    again = _trainer(run.store.url, tmp_path)  # the same name, as after a recovery
    try:
        done = stage_queue.wait(request, poll_seconds=0.05, timeout_seconds=300)
    finally:
        out = _stop(again)
    assert done["worker"] == "trainer-a" and done["epoch"] == 1, done
    assert stages.is_committed(run, "pretrain", 0)
    outcomes = [e["outcome"] for e in cost.ledger(run.store) if e["stage"] == "pretrain"]
    assert sorted(outcomes) == ["ok", "preempted"], outcomes


def test_a_pool_broken_by_another_process_fails_the_waiting_stage_within_a_check(tmp_path, monkeypatch):
    """A waiter reads the pool's broken marker every BROKEN_EVERY seconds (the flow's own pool tells it
    at no cost): written here as another process writes it, the wait raises the pool's reason."""
    from spotlight.pool import POOL_BROKEN
    from spotlight.store import RunStore

    store = RunStore(f"file://{tmp_path}/run")
    request = stage_queue.post(store, "update", 0, lease_seconds=30)
    monkeypatch.setattr(stage_queue, "BROKEN_EVERY", 0.2)
    store.put_json(POOL_BROKEN, {"slot": "trainer-0", "reason": "the trainer ended 4 times", "at": time.time()})
    started = time.monotonic()
    with pytest.raises(stage_queue.StageFailed, match="worker pool is broken: the trainer ended 4 times"):
        stage_queue.wait(request, poll_seconds=0.05, timeout_seconds=30)
    assert time.monotonic() - started < 5
