"""The run store: the manifest is the only commit point; checksums name a corrupt object; create-only claims;
a second writer or a fenced-out one never corrupts a commit; sweeps; runs written before attempt keys."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections import Counter

import pytest

from spotlight.checkpoints import OPTIMIZER, POLICY, prune
from spotlight.config import CheckpointSection
from spotlight.store import (ATTEMPT, ATTEMPT_TTL_S, MANIFEST, AlreadyExistsError, CorruptObjectError, RunStore,
                             StoreError)
from spotlight.work_queue import LeaseLostError, WorkQueue
from tests.conftest import REPO
from tests.interleave import assert_one_winner, interleavings, race, writers_objects


def test_commit_roundtrip_and_idempotence(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    commit = store.commit("iterations/0000/update", {"a.bin": b"hello", "b.json": b"{}"}, {"iteration": 0})
    assert store.is_committed("iterations/0000/update")
    assert commit.read("a.bin") == b"hello" and commit.meta == {"iteration": 0}
    again = store.commit("iterations/0000/update", {"a.bin": b"other"})
    assert again.read("a.bin") == b"hello", "a committed step is immutable"


def test_objects_without_manifest_are_not_committed(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    store.write_bytes("iterations/0001/update/policy.safetensors", b"half written")
    assert not store.is_committed("iterations/0001/update")
    commit = store.commit("iterations/0001/update", {"policy.safetensors": b"complete"})
    assert commit.read("policy.safetensors") == b"complete"


def test_corrupt_object_is_named_and_nothing_is_lost(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    commit = store.commit("iterations/0002/update", {"policy.safetensors": b"weights" * 10})
    path = tmp_path / "run" / commit.key("policy.safetensors")
    data = bytearray(path.read_bytes())
    data[3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptObjectError, match=r"iterations/0002/update/policy\.safetensors"):
        store.load("iterations/0002/update").read("policy.safetensors")
    assert path.read_bytes() == bytes(data) and store.is_committed("iterations/0002/update")


def test_create_only(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    store.create_bytes("queue/leases/item-1/0", b"worker-a")
    with pytest.raises(AlreadyExistsError):
        store.create_bytes("queue/leases/item-1/0", b"worker-b")
    assert store.read_bytes("queue/leases/item-1/0") == b"worker-a"


def test_two_writers_of_one_commit_in_every_interleaving(tmp_path):
    """A second writer of a step (a taken-over lease, another GPU type's bytes) never corrupts it."""
    url = f"file://{tmp_path}/run"
    objects = writers_objects(2)
    winners = Counter()
    for i, order in enumerate(interleavings(2)):
        name = f"iterations/{i:04d}/update"
        winners[assert_one_winner(url, name, objects, order, race(url, name, objects, order))] += 1
    assert winners == {"A": 35, "B": 35}


def test_a_worker_that_lost_its_lease_does_not_commit(tmp_path):
    url, name = f"file://{tmp_path}/run", "iterations/0003/update"
    now = [1000.0]
    queues = [WorkQueue(RunStore(url), "queues/update", lease_seconds=60, clock=lambda: now[0]) for _ in range(2)]
    queues[0].publish([{"id": "update-0003", "units": ["update-0003"]}])
    zombie = queues[0].claim("trainer-a")
    fence = queues[0].fence(zombie)
    fence.check()  # held
    now[0] += 61  # its lease expired (a stalled process, a partitioned VM) and another trainer took over
    successor = queues[1].claim("trainer-b")
    assert successor is not None and successor.epoch == 1
    store = RunStore(url)
    with pytest.raises(LeaseLostError, match="trainer-a lost its lease .* epoch 1 took over"):
        store.commit(name, {"policy.safetensors": b"zombie's bytes"}, fence=fence)
    assert fence.lost and not store.is_committed(name) and store.list(name) == [], "nothing written stays"
    # the holder commits inside its claim's fence (a fenced view of the store, as a stage gets it)
    commit = RunStore(url).fenced(queues[1].fence(successor)).commit(name, {"policy.safetensors": b"successor's"})
    assert store.load(name).read("policy.safetensors") == b"successor's" == commit.read("policy.safetensors")
    queues[1].release(successor)  # a released claim is lost too (SIGTERM path, or a relaunch's release_stale)
    with pytest.raises(LeaseLostError, match="it was released"):
        RunStore(url).fenced(queues[1].fence(successor)).commit("iterations/0004/update", {"x": b"1"})


_KILLED_MID_COMMIT = """
import os, sys, threading
from spotlight.store import MANIFEST, RunStore
store, stuck, reached = RunStore(sys.argv[1]), threading.Event(), threading.Semaphore(0)
create = store.create_bytes
def at_manifest(key, data):  # the objects are written: block where the manifest would be created
    if key.endswith(MANIFEST):
        reached.release()
        stuck.wait()
    return create(key, data)
store.create_bytes = at_manifest
for name in sys.argv[2:]:
    threading.Thread(target=store.commit, args=(name, {"policy.safetensors": b"dead " + name.encode()}), daemon=True).start()
for _ in sys.argv[2:]:
    reached.acquire()
os._exit(9)  # killed mid-commit: objects written, no manifest, no clean-up
"""


def test_sweep_removes_attempts_no_manifest_will_reference(tmp_path):
    url, superseded, abandoned = f"file://{tmp_path}/run", "iterations/0001/update", "iterations/0002/update"
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_COMMIT, url, superseded, abandoned])
    assert killed.returncode == 9
    store = RunStore(url)
    [dead] = store.list(superseded)
    assert ATTEMPT.fullmatch(dead) and not store.is_committed(superseded)
    assert store.sweep() == [], "a young attempt of an uncommitted name may still be committed by a live writer"
    commit = store.commit(superseded, {"policy.safetensors": b"the successor's"})  # the stage, retried
    assert store.sweep("iterations") == [f"{superseded}/{dead}/policy.safetensors"]
    assert store.list(superseded) == sorted([MANIFEST, commit.manifest["attempt"]])
    assert store.load(superseded).read("policy.safetensors") == b"the successor's"
    [old] = store.list(abandoned)
    assert store.sweep(now=time.time() + ATTEMPT_TTL_S - 60) == []
    assert store.sweep(now=time.time() + ATTEMPT_TTL_S + 60) == [f"{abandoned}/{old}/policy.safetensors"]
    assert store.list(abandoned) == [] and store.sweep(now=time.time() + 10 * ATTEMPT_TTL_S) == []


def test_a_run_written_before_attempt_keys_reads_prunes_and_sweeps(tmp_path):
    """Existing runs and caches resume: the v1 layout (objects at <name>/<obj>) stays readable."""
    shutil.copytree(REPO / "tests/fixtures/store-v1/run", tmp_path / "run")
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    store, key = RunStore(f"file://{tmp_path}/run"), (lambda stage, t: f"iterations/{t:04d}/{stage}")
    assert store.load("config").json("config.json") == {"run": {"name": "v1"}}
    newest = store.load(key("update", 2))
    assert newest.key(POLICY) == "iterations/0002/update/policy.safetensors"
    assert newest.tensors(POLICY)["w"].shape == (4, 4) and newest.json("metrics.json") == {"iteration": 2}
    assert store.load(key("update", 1)).tensors(POLICY)["w"].shape == (4, 4)
    with pytest.raises(StoreError, match="optimizer.safetensors was pruned by checkpoint retention"):
        store.load(key("update", 1)).read(OPTIMIZER)
    assert store.sweep() == [], "no v1 object is an attempt of anything"
    assert {p: p.read_bytes() for p in before} == before
    # the run goes on in the new layout beside the old one, and retention handles both
    store.commit(key("update", 3), {POLICY: b"theta_4", OPTIMIZER: b"adam", "metrics.json": b"{}"})
    assert prune(store, CheckpointSection(keep_last=2), 3, key) == ["iterations/0001/update/policy.safetensors",
                                                                   "iterations/0002/update/optimizer.safetensors"]
    assert store.load(key("update", 2)).read(POLICY) == before[tmp_path / "run/iterations/0002/update/policy.safetensors"]
