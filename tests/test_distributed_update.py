"""A trainer spanning several processes (as `accelerate launch` runs it in sky/trainer.yaml on several GPUs
or nodes): rank 0 pulls the posted update, each rank rolls out half of the prompt groups and trains its
share of each minibatch over gloo, and the result equals the single-process update up to float reduction
order and batch composition, committed once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from spotlight import stage_queue
from spotlight.pool import mark_pool_done
from spotlight.store import RunStore
from tests.conftest import SMALL, SPOTLIGHT, cli_env, run_cli, spotlight_cmd


def test_two_process_trainer_update_matches_single_process(tmp_path: Path, cache_url):
    overrides = [*SMALL, f"run.cache_url={cache_url}", "grpo.iterations=1"]
    single, double = tmp_path / "single", tmp_path / "double"
    for stage in ("pretrain", "filter"):
        result = run_cli(spotlight_cmd("stage", stage, overrides=[*overrides, f"run.url=file://{single}"]), tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    shutil.copytree(single, double)  # same committed filter(0): both updates start from identical inputs
    assert run_cli(spotlight_cmd("stage", "update", overrides=[*overrides, f"run.url=file://{single}"]),
                   tmp_path).returncode == 0
    store = RunStore(f"file://{double}")
    request = stage_queue.post(store, "update", 0, lease_seconds=60)
    # `--` ends torchrun's options: it would take the worker's `--run` for an abbreviation of its `--run-path`
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, "--", SPOTLIGHT, "worker", "--run", store.url, "--kind", "trainer", "--id", "ddp", "--idle-exit", "300"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        done = stage_queue.wait(request, poll_seconds=0.05, timeout_seconds=300,
                                on_poll=lambda: None if proc.poll() is None else pytest.fail(proc.stdout.read()[-4000:]))
    finally:
        mark_pool_done(store, "test over")  # both ranks leave
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert done["worker"] == "ddp" and out.count("trainer worker ddp on") == 1, "rank 0 alone pulls and reports"
    metrics = store.load("iterations/0000/update").json("metrics.json")
    assert metrics["data_parallel_processes"] == 2 and metrics["rollout_shards"] == 2  # each rank rolled out half
    a = RunStore(f"file://{single}").load("iterations/0000/update").tensors("policy.safetensors")
    b = store.load("iterations/0000/update").tensors("policy.safetensors")
    base = RunStore(cache_url).load(next(k for k in RunStore(cache_url).list("") if k.startswith("base-"))
                                    + "/final").tensors("ema.safetensors")
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the update changed the policy"
    assert diff < 1e-2 * moved, f"2-process update differs from 1-process by {diff} (update size {moved})"
