"""The run store: the manifest is the only commit point; checksums name a corrupt object; create-only claims."""

from __future__ import annotations

import pytest

from spotlight.store import AlreadyExistsError, CorruptObjectError, RunStore


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
    store.commit("iterations/0002/update", {"policy.safetensors": b"weights" * 10})
    path = tmp_path / "run/iterations/0002/update/policy.safetensors"
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
