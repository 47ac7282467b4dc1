"""A trainer spanning several nodes, launched as SkyPilot launches ``sky/trainer.yaml``: its own ``run:``
script on each node, with SkyPilot's node variables (two nodes of one GPU each). The ``accelerate launch
--multi_gpu`` there makes one world of 2 ranks: rank 0 pulls the posted update under the task's one worker
id, each rank rolls out half of the prompt groups and trains its share of each minibatch over gloo, no
rank frees the other's lease, and the result equals the single-process update up to float reduction
order and batch composition, committed once."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from spotlight import stage_queue
from spotlight.pool import mark_pool_done
from spotlight.store import RunStore
from tests.conftest import REPO, SMALL, cli_env, run_cli, spotlight_cmd
from tests.prefect_server import free_port

TASK_ID = "sky-managed-2026-12-04-10-00-00-000000_spotlight-ddp-trainer-0000_7-0"  # the same on every node


def _node_env(tmp_path: Path, run_url: str, rank: int, port: int) -> dict[str, str]:
    """What SkyPilot gives the ``run:`` script on node ``rank`` of a 2-node, 1-GPU-per-node managed job."""
    env = {k: v for k, v in cli_env(tmp_path).items() if not k.startswith(("AWS_", "WORLD_SIZE", "RANK"))}
    env.update(PATH=f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(REPO),
               RUN_URL=run_url, SPOTLIGHT_SLOT="", IDLE_EXIT="300", MASTER_PORT=str(port), SKYPILOT_TASK_ID=TASK_ID,
               SKYPILOT_NUM_NODES="2", SKYPILOT_NODE_RANK=str(rank), SKYPILOT_NODE_IPS="127.0.0.1\n127.0.0.1",
               SKYPILOT_NUM_GPUS_PER_NODE="1")
    return env


def test_two_node_trainer_from_its_yaml_is_one_world_and_matches_single_process(tmp_path: Path, cache_url):
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
    run_script = yaml.safe_load((REPO / "sky" / "trainer.yaml").read_text())["run"]
    port = free_port()
    nodes = [subprocess.Popen(["bash", "-c", run_script], cwd=REPO, env=_node_env(tmp_path, store.url, rank, port),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]

    def check_alive() -> None:
        for node in nodes:
            if node.poll() is not None:
                pytest.fail(f"a node exited early ({node.returncode}):\n{node.stdout.read()[-4000:]}")

    try:
        done = stage_queue.wait(request, poll_seconds=0.05, timeout_seconds=300, on_poll=check_alive)
    finally:
        mark_pool_done(store, "test over")  # both ranks leave
        outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    worker = TASK_ID  # SPOTLIGHT_WORKER_ID=$SKYPILOT_TASK_ID in the run script
    # one world, one worker id: rank 0 (on node 0) alone pulls and is the ready worker
    assert done["worker"] == worker and store.list("workers") == [f"{worker}.json"]
    metrics = store.load("iterations/0000/update").json("metrics.json")
    assert metrics["data_parallel_processes"] == 2 and metrics["rollout_shards"] == 2  # each rank rolled out half
    # no lease freed by a peer: one epoch, never released (independent processes sharing the id would)
    leases = store.list(f"{request.prefix}/leases/{request.item_id}")
    assert leases and all(name.startswith("000000-") and not name.endswith("released") for name in leases), leases
    a = RunStore(f"file://{single}").load("iterations/0000/update").tensors("policy.safetensors")
    b = store.load("iterations/0000/update").tensors("policy.safetensors")
    base = RunStore(cache_url).load(next(k for k in RunStore(cache_url).list("") if k.startswith("base-"))
                                    + "/final").tensors("ema.safetensors")
    moved = max((a[k] - base[k]).abs().max().item() for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert moved > 1e-4, "the update changed the policy"
    assert diff < 1e-2 * moved, f"2-node update differs from 1-process by {diff} (update size {moved})"
