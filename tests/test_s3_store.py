"""The run store on S3, against a real S3 server (moto's ThreadedMotoServer on 127.0.0.1).

What it proves: create-only writes hold on S3 (If-None-Match), listings see other writers at
once, transient outages are ridden out with retries while precondition failures are not retried,
a full run on s3:// killed with -9 resumes to the same policy bytes as an uninterrupted run, an
S3 outage mid-run leaves no corrupt or half-committed checkpoint, and no credential ever reaches
the logs or the bucket.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import boto3
import pytest

from spotlight import cost
from spotlight.store import MANIFEST, AlreadyExistsError, RequestCounts, RunStore, is_transient, request_counts
from spotlight.work_queue import LeaseLostError, WorkQueue
from tests.interleave import assert_one_winner, interleavings, race, writers_objects
from tests.moto_s3 import moto_s3
from tests.prefect_server import free_port

REPO = Path(__file__).resolve().parents[1]
SPOTLIGHT = str(Path(sys.executable).with_name("spotlight"))
BUCKET = "spotlight-test"
PLANTED_SECRET = "PLANTEDsecret+Zq7xW2vK9mN4pR8tY1uE5oI3aS6dF0gH"  # must appear nowhere
SMALL = ["pretrain.steps=60", "pretrain.commit_every=20", "pretrain.classifier_steps=60",
         "grpo.iterations=4", "grpo.prompts_per_iteration=4", "grpo.group_size=4", "grpo.optimizer_steps=3",
         "evaluation.every=4", "evaluation.seeds_per_prompt=4", "sampler.train_steps=6", "sampler.eval_steps=6",
         "exploration.mode=none"]


@pytest.fixture(scope="module")
def moto():
    with moto_s3("AKIAFAKEFAKEFAKE", PLANTED_SECRET, BUCKET) as server:
        yield server


def test_create_only_and_fresh_listings_on_s3(moto):
    store = RunStore(f"s3://{BUCKET}/unit/create")
    store.create_bytes("claims/shard-0", b"worker-a")
    with pytest.raises(AlreadyExistsError, match="claims/shard-0 exists"):
        store.create_bytes("claims/shard-0", b"worker-b")
    assert store.read_bytes("claims/shard-0") == b"worker-a"  # the loser changed nothing

    # A commit racing another writer's identical commit returns the one that won.
    first = store.commit("iterations/0000/update", {"x.bin": b"abc"}, {"iteration": 0})
    again = store.commit("iterations/0000/update", {"x.bin": b"abc"}, {"iteration": 0})
    assert again.manifest == first.manifest and again.read("x.bin") == b"abc"

    # Another process writes after we listed: the next list/exists must see it (no stale cache).
    assert store.list("iterations") == ["0000"]
    boto3.client("s3").put_object(Bucket=BUCKET, Key="unit/create/iterations/0001/update/COMMIT.json",
                                  Body=json.dumps({"name": "iterations/0001/update", "objects": {}, "meta": {}}).encode())
    assert store.list("iterations") == ["0000", "0001"]
    assert store.is_committed("iterations/0001/update")


def test_endpoint_from_storage_options(moto, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    store = RunStore(f"s3://{BUCKET}/unit/options", storage_options={"endpoint_url": moto.endpoint})
    store.write_bytes("a", b"1")
    assert store.read_bytes("a") == b"1"


def test_outage_is_retried_but_precondition_failures_are_not(moto):
    store = RunStore(f"s3://{BUCKET}/unit/outage")
    store.create_bytes("taken", b"1")
    moto.stop()
    restart = threading.Timer(3.0, moto.start)
    restart.start()
    t0 = time.monotonic()
    store.write_bytes("during-outage", b"payload")  # connection refused for ~3 s, then succeeds
    outage_s = time.monotonic() - t0
    restart.join()
    assert outage_s >= 2.5
    assert store.read_bytes("during-outage") == b"payload"
    assert store.read_bytes("taken") == b"1"  # moto kept its objects across the restart

    t0 = time.monotonic()
    with pytest.raises(AlreadyExistsError):
        store.create_bytes("taken", b"2")
    assert time.monotonic() - t0 < 1.0, "a failed precondition must fail at once, not be retried"
    assert not is_transient(FileExistsError("x")) and is_transient(ConnectionResetError("reset"))


def test_cost_ledger_on_s3(moto):
    store = RunStore(f"s3://{BUCKET}/unit/ledger")
    cost.record(store, "update", 0, 1800, 1.20, "AWS us-east-2 g6.xlarge[Spot]")
    cost.record(store, "update", 0, 900, 1.20, "GCP us-east4-a g2-standard-4[Spot]")  # retry after preemption
    cost.record(store, "explore", 0, 600, 0.0, "local")
    entries = cost.ledger(store)
    assert [(e["stage"], e["seconds"]) for e in entries] == [("explore", 600), ("update", 1800), ("update", 900)]
    assert cost.total(store) == pytest.approx(0.5 * 1.2 + 0.25 * 1.2)  # both attempts are paid for
    assert cost.stage_hours_per_iteration(entries) == {"explore": pytest.approx(600 / 3600), "update": 0.75}
    with pytest.raises(ValueError, match="must be >= 0"):
        cost.record(store, "update", 1, -1, 1.0, "x")


def test_two_writers_of_one_commit_in_every_interleaving_on_s3(moto):
    """Each writer's check, object write and manifest in all 20 orders (two objects each, 70 orders, in
    test_store.py's local twin): the commit always loads and equals exactly one writer's bytes (the first
    manifest's), never a CorruptObjectError, for a fresh reader and both writers; the loser cleans up."""
    url = f"s3://{BUCKET}/unit/race"
    objects = writers_objects(1)
    winners = {"A": 0, "B": 0}
    for i, order in enumerate(interleavings(1)):
        name = f"iterations/{i:04d}/update"
        winners[assert_one_winner(url, name, objects, order, race(url, name, objects, order))] += 1
    assert winners == {"A": 10, "B": 10}


def test_a_fenced_out_writer_commits_nothing_on_s3(moto):
    url, now = f"s3://{BUCKET}/unit/fence", [1000.0]
    queue = WorkQueue(RunStore(url), "queues/update", lease_seconds=60, clock=lambda: now[0])
    queue.publish([{"id": "update-0000", "units": ["update-0000"]}])
    zombie = queue.claim("trainer-a")
    now[0] += 61
    successor = queue.claim("trainer-b")
    with pytest.raises(LeaseLostError, match="epoch 1 took over"):
        RunStore(url).fenced(queue.fence(zombie)).commit("iterations/0000/update", {"p": b"zombie"})
    store = RunStore(url)
    assert not store.is_committed("iterations/0000/update") and store.list("iterations/0000/update") == []
    store.fenced(queue.fence(successor)).commit("iterations/0000/update", {"p": b"holder"})
    assert store.load("iterations/0000/update").read("p") == b"holder"


class _ServerLog(logging.Handler):
    """The requests moto's server answered, from its werkzeug access log (logged before each response)."""

    LINE = re.compile(r'"(GET|PUT|HEAD|DELETE|POST) (\S+) HTTP/')
    COLOUR = re.compile(r"\x1b\[[0-9;]*m")  # werkzeug colours the lines of 4xx answers

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.requests: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        m = self.LINE.search(self.COLOUR.sub("", record.getMessage()))
        if m:
            self.requests.append((m.group(1), m.group(2)))

    def by_class(self) -> RequestCounts:
        """Billing classes from the HTTP requests themselves: a GET with list-type is a LIST."""
        kinds = ["free" if method == "DELETE" else
                 "put" if method in ("PUT", "POST") or (method == "GET" and "list-type=" in path) else "get"
                 for method, path in self.requests]
        return RequestCounts(put=kinds.count("put"), get=kinds.count("get"), free=kinds.count("free"))


def test_request_counts_are_what_botocore_sent(moto):
    """Every HTTP request s3fs sends is counted once, by AWS billing class, per process (children share
    the counter); attempts that never reached the server are counted and marked unanswered."""
    werkzeug = logging.getLogger("werkzeug")
    server, level = _ServerLog(), werkzeug.level
    werkzeug.setLevel(logging.INFO)
    werkzeug.addHandler(server)
    try:
        store = RunStore(f"s3://{BUCKET}/unit/requests")
        child = store.child("queue")
        before = store.requests()
        store.write_bytes("a", b"1")  # PUT
        child.create_bytes("lease", b"2")  # PUT, If-None-Match: *
        with pytest.raises(AlreadyExistsError):
            child.create_bytes("lease", b"3")  # PUT, answered 412
        assert store.exists("a") and not store.exists("missing")  # HEAD, HEAD (never a LIST)
        assert store.read_bytes("a") == b"1"  # HEAD (s3fs sizes a read first), GET
        assert child.get_json("lease") == 2  # GET (a small record: no HEAD)
        assert store.list("") == ["a", "queue"]  # LIST
        commit = store.commit("c", {"x": b"abc"})  # HEAD (committed already?), PUT, PUT (manifest)
        assert store.load("c").read("x") == b"abc"  # GET, GET
        store.delete(commit.key("x"))  # DELETE
        sent = store.requests() - before
    finally:
        werkzeug.removeHandler(server)
        werkzeug.setLevel(level)
    assert sent == RequestCounts(put=6, get=8, free=1, unanswered=0)
    assert sent == server.by_class(), f"the server saw {server.requests}"
    assert child.requests() == store.requests() == request_counts()
    assert sent.cost_usd() == pytest.approx(6 * 0.005 / 1000 + 8 * 0.0004 / 1000)

    closed = f"http://127.0.0.1:{free_port()}"  # every attempt refused: with_retries 2 x botocore's 2
    before = request_counts()
    with pytest.raises(Exception, match="Could not connect"):
        RunStore(f"s3://{BUCKET}/unit/requests", {"endpoint_url": closed}, retry_delays=(0.05,)).write_bytes("b", b"1")
    assert request_counts() - before == RequestCounts(put=4, unanswered=4)


# -- full runs in real subprocesses ------------------------------------------------------------
def _cmd(name: str) -> list[str]:
    return [SPOTLIGHT, "run", "--run", f"s3://{BUCKET}/runs/{name}", "--set", f"run.name={name}",
            "--set", f"run.cache_url=s3://{BUCKET}/cache", *[a for kv in SMALL for a in ("--set", kv)]]


def _env(tmp: Path) -> dict[str, str]:
    # moto on this machine: a look costs nothing, so poll fast (what S3's pacing costs is measured by the
    # emulated cluster, tests/test_emulated_cluster.py, at the default); a run killed with -9 leaves its
    # temporary files in the test's folder
    (tmp / "tmp").mkdir(exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "SPOTLIGHT_POLL_SECONDS": "0.2",
            "TMPDIR": str(tmp / "tmp")}


@pytest.fixture
def procs():
    """Runs started by a test; any still alive when it ends (a failed assertion) are killed."""
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _start(procs: list, name: str, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(_cmd(name), cwd=REPO, env=_env(log.parent), stdout=log.open("ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    procs.append(proc)
    return proc


def _wait_for(store: RunStore, name: str, proc: subprocess.Popen, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    while not store.is_committed(name):
        assert proc.poll() is None, f"run exited ({proc.returncode}) before {name} was committed"
        assert time.monotonic() < deadline, f"{name} not committed within {timeout}s"
        time.sleep(0.2)


def _finish(proc: subprocess.Popen, log: Path, timeout: float = 170) -> None:
    rc = proc.wait(timeout=timeout)
    assert rc == 0, f"run failed ({rc}):\n{log.read_text()[-4000:]}"


def _policy(name: str, it: int = 3) -> bytes:
    return RunStore(f"s3://{BUCKET}/runs/{name}").load(f"iterations/{it:04d}/update").read("policy.safetensors")


def test_full_run_on_s3_survives_kill_and_outage_and_leaks_no_secret(moto, tmp_path, procs):
    logs = tmp_path / "logs"
    logs.mkdir()
    # 1. reference run (pretrains once into the shared cache) with an S3 outage mid-write:
    #    stop the server while iteration 1 is being written, start it again on the same port.
    ref_log = logs / "ref.log"
    ref = _start(procs, "s3ref", ref_log)
    t0 = time.monotonic()
    _wait_for(RunStore(f"s3://{BUCKET}/runs/s3ref"), "iterations/0001/filter", ref)
    print(f"ref: pretrain + 1.5 iterations {time.monotonic() - t0:.1f}s")
    moto.stop()
    time.sleep(6.0)
    moto.start()
    _finish(ref, ref_log)
    print(f"ref: done {time.monotonic() - t0:.1f}s")
    assert "transient error" in ref_log.read_text(), "the outage did not hit a request (no retry logged)"

    # 2. the same run under another name, killed -9 (whole process group) mid-run, then resumed.
    x_log = logs / "x.log"
    x = _start(procs, "s3x", x_log)
    _wait_for(RunStore(f"s3://{BUCKET}/runs/s3x"), "iterations/0001/update", x)
    os.killpg(x.pid, signal.SIGKILL)
    x.wait()
    assert not RunStore(f"s3://{BUCKET}/runs/s3x").is_committed("iterations/0003/update")
    resumed = _start(procs, "s3x", x_log)
    _finish(resumed, x_log)
    print(f"kill + resume: done {time.monotonic() - t0:.1f}s")
    assert _policy("s3x") == _policy("s3ref"), "resumed run's final policy differs from the uninterrupted one"

    # 3. every commit in the bucket verifies by checksum (nothing corrupt, nothing half-committed).
    s3 = boto3.client("s3")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])]
    # only the runs': the unit tests above share the bucket and delete objects on purpose
    manifests = [k for k in keys if k.startswith("runs/") and k.endswith("/" + MANIFEST)]
    assert len(manifests) > 20
    bucket = RunStore(f"s3://{BUCKET}")
    for key in manifests:
        commit = bucket.load(key[: -len("/" + MANIFEST)])
        for obj in commit.manifest["objects"]:
            commit.read(obj)  # raises CorruptObjectError on a checksum mismatch

    # 4. no credential in any log (the runs' own and what their workers left in their temporary folder) or object.
    files = [f for f in logs.rglob("*") if f.is_file()]
    assert {"ref.log", "x.log"} <= {f.name for f in files}
    for log in files:
        assert PLANTED_SECRET not in log.read_text(errors="replace"), f"secret leaked into {log.relative_to(logs)}"
    for key in keys:
        body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        assert PLANTED_SECRET.encode() not in body, f"secret leaked into s3://{BUCKET}/{key}"
    assert RunStore(f"s3://{BUCKET}/runs/s3x").load("config").json("config.json")["run"]["name"] == "s3x"
