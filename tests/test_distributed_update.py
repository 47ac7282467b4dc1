"""The update stage as several data-parallel processes (as `accelerate launch` runs it in sky/update.yaml):
each rolls out half of the prompt groups, and two processes on gloo give the single-process result up
to float reduction order and batch composition, and commit once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import torch

from spotlight.store import RunStore
from tests.conftest import SMALL, cli_env, run_cli, spotlight_cmd


def test_two_process_update_matches_single_process(tmp_path: Path, cache_url):
    overrides = [*SMALL, f"run.cache_url={cache_url}", "grpo.iterations=1"]
    single, double = tmp_path / "single", tmp_path / "double"
    for stage in ("pretrain", "filter"):
        result = run_cli(spotlight_cmd("stage", stage, overrides=[*overrides, f"run.url=file://{single}"]), tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
    shutil.copytree(single, double)  # same committed filter(0): both updates start from identical inputs
    assert run_cli(spotlight_cmd("stage", "update", overrides=[*overrides, f"run.url=file://{single}"]),
                   tmp_path).returncode == 0
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd = [*torchrun, *spotlight_cmd("stage", "update", overrides=[*overrides, f"run.url=file://{double}"])]
    result = subprocess.run(cmd, cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert (result.stdout + result.stderr).count("committed file:") == 2, "both ranks finish with the commit"
    metrics = RunStore(f"file://{double}").load("iterations/0000/update").json("metrics.json")
    assert metrics["data_parallel_processes"] == 2 and metrics["rollout_shards"] == 2  # each rank rolled out half
    a = RunStore(f"file://{single}").load("iterations/0000/update").tensors("policy.safetensors")
    b = RunStore(f"file://{double}").load("iterations/0000/update").tensors("policy.safetensors")
    base = RunStore(cache_url).load(next(k for k in RunStore(cache_url).list("") if k.startswith("base-"))
                                    + "/final").tensors("ema.safetensors")
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the update changed the policy"
    assert diff < 1e-2 * moved, f"2-process update differs from 1-process by {diff} (update size {moved})"
