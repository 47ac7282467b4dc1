"""The exploration work queue: lease epochs, create-only claims and completions, and real worker
processes that get SIGTERM, kill -9 and races, ending with the same results table as a fault-free run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pytest

from queue_handler import handler, make_items, unit_result
from spotlight import pool, stage_queue
from spotlight.pool import S3_POLL
from spotlight.store import RequestCounts, RunStore, counting_requests, request_counts
from spotlight.work_queue import Claim, LeaseLostError, QueueError, WorkQueue
from spotlight.queue_worker import run_worker
from tests.moto_s3 import moto_s3

HANDLER = Path(__file__).with_name("queue_handler.py")
REPO = HANDLER.parents[1]


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def moto_endpoint():
    """A local S3 (moto) that this process and worker subprocesses reach the way a worker does: by env."""
    with moto_s3("fake-key", "fake-secret") as server:
        yield server.endpoint


def make_store(kind: str, tmp_path: Path, moto_endpoint: str | None) -> RunStore:
    if kind == "file":
        return RunStore(f"file://{tmp_path}/run")
    assert moto_endpoint
    bucket = f"queue-{uuid.uuid4().hex[:12]}"
    store = RunStore(f"s3://{bucket}/run")
    store.fs.mkdir(bucket)
    return store


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path) -> RunStore:
    return make_store(request.param, tmp_path, request.getfixturevalue("moto_endpoint") if request.param == "s3" else None)


# -- lease epochs, with an injected clock ------------------------------------------------------------
def lease_scenario(store: RunStore) -> list[Any]:
    """Claim, renew, expiry, takeover, zombie writes, release; returns what it observed (no timestamps)."""
    clock, seen = FakeClock(), []
    qa, qb = (WorkQueue(store, "q", lease_seconds=10, clock=clock) for _ in range(2))  # two workers' views
    qa.publish(make_items(2, 3, 0.0))
    a = qa.claim("wa")
    b_first = qb.claim("wb")
    assert a is not None and b_first is not None and a.epoch == b_first.epoch == 0 and a.item_id != b_first.item_id
    qb.release(b_first)
    with pytest.raises(LeaseLostError, match="released"):
        qb.renew(b_first)
    seen.append(qb.status())
    assert qb.status() == {"items": 2, "done": 0, "leased": 1, "free": 1, "units_done": 0, "units_total": 6}

    clock.now += 8
    qa.renew(a)  # heartbeat: expires at +18 instead of +10
    b = qb.claim("wb")
    assert b is not None and b.item_id == b_first.item_id and b.epoch == 1, "a released item is claimable at once"
    assert qb.claim("wc") is None, "the other item is still leased"
    clock.now += 7  # +15: past the first expiry, before the renewed one
    assert qb.claim("wc") is None, "renew extended the lease"
    qb.renew(b)
    clock.now += 3  # +18: expired
    c = qb.claim("wc")
    assert c is not None and c.item_id == a.item_id and c.epoch == 1, "an expired lease is taken over by the next epoch"
    with pytest.raises(LeaseLostError, match="epoch 1 took over"):
        qa.renew(a)

    units = a.item["units"]
    seen.append(qa.record(a, {units[0]: "from the zombie"}))  # the old holder did not notice yet
    seen.append(qb.record(c, {units[0]: "from the new holder", units[1]: "u1"}))
    assert qb.pending_units(c.item_id) == units[2:], "a re-claimed item skips recorded units"
    with pytest.raises(QueueError, match="1 units not recorded"):
        qb.complete(c)
    qb.record(c, {units[2]: "u2"})
    done = [qa.complete(a), qb.complete(c)]
    assert done == [True, False], "exactly one completion; the other learns it lost"
    seen += [done, qb.done_by(a.item_id), qb.results()]
    assert qb.results()[units[0]] == "from the zombie", "a unit recorded twice keeps the first result"
    seen.append(qa.status())
    return seen


def test_lease_epochs_expiry_renew_takeover(store):
    seen = lease_scenario(store)
    assert seen[-1] == {"items": 2, "done": 1, "leased": 1, "free": 0, "units_done": 3, "units_total": 6}


def test_local_and_s3_queues_behave_the_same(tmp_path, moto_endpoint):
    local, s3 = make_store("file", tmp_path, None), make_store("s3", tmp_path, moto_endpoint)
    assert lease_scenario(local) == lease_scenario(s3)
    tables = []
    for store in (local, s3):
        queue = WorkQueue(store, "drain", lease_seconds=5)
        queue.publish(make_items(3, 4, 0.0))
        stats = run_worker(queue, handler, worker_id="w", batch_units=3)
        assert sorted(stats["items_completed"]) == ["i000", "i001", "i002"]
        assert queue.drained() and stats["units_done"] == 12 and stats["utilisation"] == 1.0
        tables.append(queue.results())
    assert tables[0] == tables[1] == {u: unit_result(u) for it in make_items(3, 4, 0.0) for u in it["units"]}


def test_publish_is_one_commit_idempotent_and_validated(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    queue = WorkQueue(store, "q")
    store.write_bytes("q/items/items.json", b"[half a publish")  # objects without their manifest
    assert not queue.published() and queue.claim("w") is None and not queue.drained() and queue.items() == []
    items = make_items(2, 2, 0.0)
    queue.publish(items)
    queue.publish(items)  # same items: a no-op
    assert WorkQueue(store, "q").items() == items
    with pytest.raises(QueueError, match="already holds 2 other items"):
        WorkQueue(store, "q").publish(make_items(3, 2, 0.0))
    with pytest.raises(QueueError, match="bad unit name 'a/b'"):
        WorkQueue(store, "x").publish([{"id": "i", "units": ["a/b"]}])
    with pytest.raises(QueueError, match="appears twice"):
        WorkQueue(store, "x").publish([{"id": "i", "units": ["u"]}, {"id": "j", "units": ["u"]}])
    claim = queue.claim("w")
    with pytest.raises(QueueError, match="has no units"):
        queue.record(claim, {"nonsense": 1})


def race(n: int, fn: Callable[[int], Any]) -> list[Any]:
    """Run fn(0..n-1) in n threads released together."""
    barrier, out = threading.Barrier(n), [None] * n

    def go(i: int) -> None:
        barrier.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_racing_threads_never_share_a_lease_epoch_or_a_completion(tmp_path):
    store, clock, n = RunStore(f"file://{tmp_path}/run"), FakeClock(), 8
    queues = [WorkQueue(store, "q", lease_seconds=10, clock=clock) for _ in range(n)]  # separate objects
    queues[0].publish(make_items(1, 2, 0.0))
    claims: list[Claim] = []
    for _ in range(3):  # epochs 0, 1, 2: each raced by n workers after the previous one expired
        won = [c for c in race(n, lambda i: queues[i].claim(f"w{i}")) if c is not None]
        assert len(won) == 1 and won[0].epoch == len(claims)
        claims.append(won[0])
        clock.now += 11
    queues[0].record(claims[0], {u: unit_result(u) for u in claims[0].item["units"]})
    completed = race(3 * 4, lambda i: queues[i % n].complete(claims[i % 3]))
    assert completed.count(True) == 1
    assert queues[0].done_by("i000") == claims[completed.index(True) % 3].worker


def test_failing_handler_keeps_finished_units_and_hands_the_item_back(tmp_path):
    queue = WorkQueue(RunStore(f"file://{tmp_path}/run"), "q", lease_seconds=60)
    queue.publish(make_items(1, 5, 0.0))

    def broken(item: dict[str, Any], units: list[str]):
        for unit in units:
            if unit.endswith("u03"):
                raise RuntimeError("reward model fell over")
            yield unit, unit_result(unit)

    with pytest.raises(RuntimeError, match="fell over"):
        run_worker(queue, broken, worker_id="w", batch_units=5)
    assert sorted(queue.results()) == ["i000-u00", "i000-u01", "i000-u02"]
    claim = queue.claim("other")
    assert claim is not None and claim.epoch == 1, "released, not stuck behind a 60 s lease"


def test_worker_that_lost_its_lease_stops_without_completing(tmp_path):
    """A worker presumed dead (its lease expired, e.g. a long pause) learns it at its next heartbeat."""
    store = RunStore(f"file://{tmp_path}/run")
    queue = WorkQueue(store, "q", lease_seconds=0.6)
    queue.publish(make_items(1, 6, 0.0))
    thief = WorkQueue(store, "q", lease_seconds=60, clock=lambda: time.time() + 3600)  # sees the lease expired
    stolen: list[Claim] = []

    def slow(item: dict[str, Any], units: list[str]):
        for unit in units:
            if not stolen:
                stolen.append(thief.claim("thief"))
            time.sleep(0.25)
            yield unit, unit_result(unit)

    stats = run_worker(queue, slow, worker_id="w", poll_seconds=0.05, idle_exit_seconds=0.0)
    assert stolen[0].epoch == 1 and stats["leases_lost"] == ["i000"] and not stats["items_completed"]
    assert 1 <= stats["units_done"] < 6
    thief.record(stolen[0], {u: unit_result(u) for u in thief.pending_units("i000")})
    assert thief.complete(stolen[0]) and queue.done_by("i000") == "thief"


# -- real worker processes -----------------------------------------------------------------------------
def spawn(url: str, prefix: str, worker: str, *args: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, str(HANDLER), url, prefix, worker, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def ready(*procs: subprocess.Popen) -> None:
    """Wait until each worker has installed its SIGTERM handler (its first stdout line)."""
    for proc in procs:
        line = proc.stdout.readline()
        assert line.startswith('{"ready"'), f"worker did not start: {line!r} {proc.stderr.read()[-3000:]}"


def finish(proc: subprocess.Popen, timeout: float = 60) -> tuple[int, dict[str, Any] | None]:
    out, err = proc.communicate(timeout=timeout)
    lines = out.strip().splitlines()
    assert proc.returncode in (0, -signal.SIGKILL), f"worker failed (rc {proc.returncode}):\n{err[-3000:]}"
    return proc.returncode, json.loads(lines[-1]) if lines else None


def wait_until(pred: Callable[[], bool], timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def wait_for(get: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """``get()``'s first value that is not None."""
    deadline = time.monotonic() + timeout
    while (value := get()) is None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def recorded(queue: WorkQueue, item_id: str) -> int:
    return len(queue.item(item_id)["units"]) - len(queue.pending_units(item_id))


def lease_objects(store: RunStore, prefix: str, item_id: str) -> list[str]:
    return [n for n in store.list(f"{prefix}/leases/{item_id}") if "." not in n]


def held_by(queue: WorkQueue, worker: str, units_left: int) -> str | None:
    """An item whose latest claim is ``worker``'s, not released, with at least ``units_left`` units to go:
    a signal sent now lands while the worker holds it (under load a worker may be between items)."""
    for item in queue.items():
        names = lease_objects(queue.store, queue.prefix, item["id"])
        claims = sorted(n for n in names if n.endswith("-000000"))
        if not claims or f"{claims[-1][:6]}-released" in names:
            continue
        lease = queue.store.get_json(f"{queue.prefix}/leases/{item['id']}/{claims[-1]}")
        if lease["worker"] == worker and len(queue.pending_units(item["id"])) >= units_left:
            return item["id"]
    return None


def test_sigterm_records_finished_units_releases_the_item_and_exits_0(tmp_path):
    url = f"file://{tmp_path}/run"
    queue = WorkQueue(RunStore(url), "q", lease_seconds=60)
    queue.publish(make_items(1, 10, 0.2))
    proc = spawn(url, "q", "spot-a", "--lease", "60")
    ready(proc)
    wait_until(lambda: recorded(queue, "i000") >= 2, what="the worker to record 2 units")
    proc.send_signal(signal.SIGTERM)
    rc, stats = finish(proc, timeout=10)
    assert rc == 0 and stats["stopped"] and stats["items_released"] == ["i000"] and not stats["items_completed"]
    results = queue.results()
    assert 2 <= len(results) < 10 and stats["units_done"] == len(results)
    assert results == {u: unit_result(u) for u in results}, "its finished units are committed"
    claim = queue.claim("spot-b")  # the 60 s lease is far from expiry: only the release makes this possible
    assert claim is not None and claim.epoch == 1
    assert queue.pending_units("i000") == queue.item("i000")["units"][len(results):]
    queue.release(claim)
    stats_b = run_worker(queue, handler, worker_id="spot-b", poll_seconds=0.05)
    assert stats_b["units_done"] == 10 - len(results) and queue.drained()
    assert queue.results() == {u: unit_result(u) for u in queue.item("i000")["units"]}


def test_kill9_loses_only_unrecorded_units_and_lease_expiry_requeues_the_item(tmp_path):
    url, lease = f"file://{tmp_path}/run", 3.0
    store = RunStore(url)
    queue = WorkQueue(store, "q", lease_seconds=lease)
    queue.publish(make_items(1, 10, 0.2))
    proc = spawn(url, "q", "spot-a", "--lease", str(lease))
    wait_until(lambda: recorded(queue, "i000") >= 3, what="the worker to record 3 units")
    proc.kill()
    assert finish(proc)[0] == -signal.SIGKILL
    before = queue.results()
    assert queue.claim("spot-x") is None, "the dead worker's lease has not expired yet"
    last_expiry = max(store.get_json(f"q/leases/i000/{n}")["expires"] for n in lease_objects(store, "q", "i000"))
    rc, stats = finish(spawn(url, "q", "spot-b", "--lease", str(lease)))
    assert rc == 0 and stats["items_completed"] == ["i000"]
    assert stats["units_done"] == 10 - len(before), "the re-claimed item skipped the recorded units"
    takeover = store.get_json("q/leases/i000/000001-000000")
    assert takeover["worker"] == "spot-b" and takeover["expires"] - lease >= last_expiry, "claimed only after expiry"
    assert queue.results() == {u: unit_result(u) for u in queue.item("i000")["units"]}


def test_racing_worker_processes_complete_each_item_exactly_once(tmp_path):
    url = f"file://{tmp_path}/run"
    queue = WorkQueue(RunStore(url), "q", lease_seconds=10)
    procs = [spawn(url, "q", f"spot-{i}", "--poll", "0.1") for i in range(4)]
    ready(*procs)  # every worker is polling; publish now, so they all race from the first claim
    items = make_items(40, 2, 0.01)
    queue.publish(items)
    stats = [finish(p)[1] for p in procs]
    completions = [item for s in stats for item in s["items_completed"]]
    assert sorted(completions) == [it["id"] for it in items], "complete() returned True exactly once per item"
    for s in stats:
        assert all(queue.done_by(item) == s["worker"] for item in s["items_completed"])
    assert sum(1 for s in stats if s["items_completed"]) >= 2, "the work was shared"
    assert queue.results() == {u: unit_result(u) for it in items for u in it["units"]}


def test_results_after_sigterm_kill9_and_races_equal_a_fault_free_run(store):
    url, lease = store.url, 1.5
    items = make_items(8, 6, 0.1)
    clean = WorkQueue(store, "clean", lease_seconds=lease)
    clean.publish(items)
    clean_stats = run_worker(clean, handler, worker_id="solo", batch_units=2)
    assert sorted(clean_stats["items_completed"]) == [it["id"] for it in items]

    faulty = WorkQueue(store, "faulty", lease_seconds=lease)
    procs = {name: spawn(url, "faulty", name, "--lease", str(lease), "--batch", "2", "--poll", "0.05")
             for name in ("term", "kill", "steady")}
    ready(*procs.values())
    faulty.publish(items)
    signalled = {}
    for name in ("term", "kill"):  # each while it holds an item with two batches to go (>= 0.2 s of work)
        signalled[name] = wait_for(lambda: held_by(faulty, name, units_left=4), what=f"{name} to hold an item")
        if name == "term":
            procs["term"].send_signal(signal.SIGTERM)
        else:
            procs["kill"].kill()
    late = spawn(url, "faulty", "late", "--lease", str(lease), "--batch", "2", "--poll", "0.05")
    rc_term, term = finish(procs["term"])
    rc_kill, _ = finish(procs["kill"])
    rc_steady, steady = finish(procs["steady"])
    rc_late, late_stats = finish(late)
    assert (rc_term, rc_kill, rc_steady, rc_late) == (0, -signal.SIGKILL, 0, 0)
    assert term["stopped"] and not steady["stopped"] and faulty.drained()
    assert signalled["term"] in term["items_released"], "SIGTERM landed mid-item: the item was handed back"
    taken_over = [it["id"] for it in items if "000001-000000" in lease_objects(store, "faulty", it["id"])]
    assert set(signalled.values()) <= set(taken_over), "the released and the expired item were claimed again"
    assert faulty.results() == clean.results() == {u: unit_result(u) for it in items for u in it["units"]}


# -- the `spotlight worker` command on a real run --------------------------------------------------------
def test_spotlight_worker_command_explores_a_runs_queue(small_overrides, tmp_path):
    from conftest import SPOTLIGHT, cli_env

    from spotlight import exploration
    from spotlight.config import load_config
    from spotlight.prompts import iteration_prompts as prompts_for
    from spotlight.run import open_run
    from spotlight.stages import pretrain

    cfg = load_config(REPO / "configs/tiny.yaml", [*small_overrides, "exploration.mode=spotlight"])
    run = open_run(cfg)
    pretrain(run)
    items = exploration.make_items(prompts_for(cfg, 1)[:2], exploration.candidate_seeds(cfg, 1, [4, 4]), batch=2)
    queue = exploration.queue_for(run, 1)
    queue.publish(items)
    proc = subprocess.run([SPOTLIGHT, "worker", "--run", cfg.run_url, "--id", "cli-worker", "--idle-exit", "0"],
                          cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worker cli-worker" in proc.stdout and "utilisation" in proc.stdout
    assert queue.drained() and {queue.done_by(it["id"]) for it in items} == {"cli-worker"}
    results = queue.results()
    assert sorted(results) == ["p000-b000", "p000-b001", "p001-b000", "p001-b001"]
    # The same units rolled out here give the same rewards: a re-run after preemption changes nothing.
    here = dict(exploration.explore_units(run, 1, items[1], ["p001-b001"]))
    assert here["p001-b001"]["rewards"] == results["p001-b001"]["rewards"]
    assert results["p001-b001"]["seeds"] == items[1]["batches"]["p001-b001"]


# -- waiting is O(1) requests a look ------------------------------------------------------------------
def test_waiting_costs_the_same_few_requests_a_look_whatever_the_queues_size(moto_endpoint, tmp_path):
    """On S3 (moto), counted as AWS bills them: with every item of a 28-item queue held by busy workers,
    an idle worker's look for work is one HEAD (``freed.json``) and a waiter's look one GET
    (``progress.json``), a stage waiter's too (it reads the pool's broken marker every few seconds). A
    change costs a waiter nothing more (the signal's body names it, and a completion the done items), a
    body it cannot read makes it list the done markers; a hand-back or a lease that may have expired makes
    an idle worker's next look a full one (2 LISTs, however many items)."""
    costs = {}
    for n in (4, 28):
        store = make_store("s3", tmp_path, moto_endpoint)
        busy, idle, waiter = (WorkQueue(store, "q", lease_seconds=60) for _ in range(3))
        busy.publish(make_items(n, 2, 0.0))
        claims = [busy.claim(f"busy{i}") for i in range(n)]
        assert all(claims)

        def cost(fn, looks: int = 5) -> list[RequestCounts]:
            out = []
            for _ in range(looks):
                before = request_counts()
                fn()
                out.append(request_counts() - before)
            return out

        first, *steady = cost(lambda: idle.claim("idle"))
        assert first.put == 2 and all(c == RequestCounts(get=1) for c in steady), (first, steady)  # 2 LISTs, then 1 HEAD
        first, *steady = cost(waiter.look)
        assert all(c == RequestCounts(get=1) for c in steady), steady
        costs[n] = steady[-1]
        busy.record(claims[0], {claims[0].item["units"][0]: unit_result(claims[0].item["units"][0])})
        assert cost(waiter.look, 1) == [RequestCounts(get=1)] and waiter.last_event == "units"  # no listing
        assert cost(lambda: idle.claim("idle"), 1) == [RequestCounts(get=1)]  # nothing was handed back
        if n == 4:  # every completion is seen in the body: the last look says drained, still one GET
            for c in claims:
                busy.record(c, {u: unit_result(u) for u in c.item["units"]})
                assert busy.complete(c)
                assert cost(waiter.look, 1) == [RequestCounts(get=1)] and waiter.last_event == "done"
            assert waiter.look()[1], "drained, from the completions' bodies alone"
            store.write_bytes("q/progress.json", b"not json")  # a body it cannot read: it lists
            assert cost(waiter.look, 1) == [RequestCounts(put=1, get=1)]
            continue
        busy.release(claims[-1])
        took = idle.claim("idle")
        assert took is not None and took.item_id == claims[-1].item_id  # the hand-back is seen at once
    assert costs[4] == costs[28] == RequestCounts(get=1), "a look does not grow with the queue"
    # a watcher's first look at a queue another process just published: the body says nothing happened since
    publisher, watcher = WorkQueue(store, "fresh", lease_seconds=60), WorkQueue(store, "fresh", lease_seconds=60)
    publisher.publish(make_items(3, 2, 0.0))
    assert watcher.items()  # the published items, read once (3 requests) and cached
    before = request_counts()
    assert watcher.look() == (True, False) and request_counts() - before == RequestCounts(get=1)
    # a stage waiter: one HEAD of the attempt's progress a look
    store = make_store("s3", tmp_path, moto_endpoint)
    request = stage_queue.post(store, "update", 0, lease_seconds=60)
    looks: list[RequestCounts] = []
    last = [request_counts()]

    class Enough(Exception):
        pass

    def on_poll() -> None:  # called once a look: what the look cost; six looks are enough
        now = request_counts()
        looks.append(now - last[0])
        last[0] = now
        if len(looks) == 6:
            raise Enough

    with pytest.raises(Enough):
        stage_queue.wait(request, poll_seconds=0.01, on_poll=on_poll)
    # the first too: posted by this process, nothing is done (no listing); the broken marker is read after 15 s
    assert all(c == RequestCounts(get=1) for c in looks), looks
    low, high = S3_POLL
    print(f"S3 requests a look while waiting: idle worker {costs[28].billed} (queue of 28 held items), waiter "
          f"{looks[-1].billed}; at the longest pause ({high:g} s) that is {costs[28].billed / high:.2f} and "
          f"{looks[-1].billed / high:.2f} requests per second")


def test_the_board_tells_idle_trainers_what_was_posted_for_whom_and_what_settled(moto_endpoint, tmp_path):
    """On S3 (moto): an idle worker's look is one GET of the pool's board, whose numbered notices name what
    the flow posted (a stage, for the trainer that finished the flow's last one), and what settled since;
    the flow's waiter learns the completion, done marker included, from one GET of the attempt's signal.
    A reader that cannot follow the notices (its first read, a reader further behind than the board
    keeps, a board another process wrote, a pool change) is told to list instead."""
    store = make_store("s3", tmp_path, moto_endpoint)

    def counted(fn):
        before = request_counts()
        out = fn()
        return out, request_counts() - before

    reader = pool.BoardReader(store)
    assert reader.read() is None, "no board yet: list"
    stage_queue.post(store, "pretrain", 0, lease_seconds=60)
    assert reader.read() is None, "the first sight of this board's writer: list"
    update = stage_queue.post(store, "update", 0, lease_seconds=60)
    news, cost = counted(reader.read)
    assert cost == RequestCounts(get=1) and [(n["kind"], n["name"], n["designated"]) for n in news] == \
        [("stage", update.name, None)]
    assert counted(reader.read) == ([], RequestCounts(get=1)), "nothing new: one GET, nothing to do"
    trainer = WorkQueue(store, update.prefix, lease_seconds=60)  # the trainer's own view of the attempt
    claim = trainer.claim("trainer-a")
    trainer.record(claim, {update.item_id: {"commit": "iterations/0000/update", "worker": "trainer-a"}})
    assert trainer.complete(claim)
    done, cost = counted(lambda: stage_queue.wait(update, poll_seconds=0.01))
    assert done["worker"] == "trainer-a" and cost == RequestCounts(get=1), (done, cost)  # no marker GET
    assert pool.seen_committed(store, "iterations/0000/update")
    evaluate = stage_queue.post(store, "evaluate", 0, lease_seconds=60)
    news, cost = counted(reader.read)
    assert cost == RequestCounts(get=1) and news == [dict(news[0], kind="stage", name=evaluate.name,
                                                          designated="trainer-a", settled=[update.name])]
    # further behind than the board keeps: list
    for i in range(pool.BOARD_KEEP + 1):
        pool.post_notice(store, f"posted test-{i}", kind="stage", name=f"test-{i:04d}")
    assert reader.read() is None
    assert reader.read() == []
    pool.post_notice(store, "posted test-last", kind="stage", name="test-last")
    assert [n["name"] for n in reader.read()] == ["test-last"], "caught up: follows again"
    pool._BOARDS.pop(store.url)  # as if a restarted flow (another process) wrote the board
    pool.post_notice(store, "posted again", kind="stage", name="again")
    assert reader.read() is None
    pool.mark_pool_done(store, "the test is over")
    assert reader.read() is None, "a pool change: list (the pool is done)"


def test_a_waiting_thread_counts_its_own_requests_not_its_neighbours(moto_endpoint, tmp_path):
    """What waiting costs is counted per thread (s3fs sends every request from its own event loop; the
    calling thread's context follows them there): a thread doing work beside a waiter adds nothing to it."""
    store = make_store("s3", tmp_path, moto_endpoint)
    store.write_bytes("k", b"x")
    before, own = request_counts(), {}
    started = threading.Event()

    def neighbour() -> None:
        started.set()
        for _ in range(12):
            store.read_bytes("k", small=True)

    with counting_requests() as sent:
        thread = threading.Thread(target=neighbour)
        thread.start()
        started.wait()
        for _ in range(3):
            store.read_bytes("k", small=True)
        thread.join()
        own["waiter"] = sent()
    assert own["waiter"] == RequestCounts(get=3)
    assert request_counts() - before == RequestCounts(get=15)
