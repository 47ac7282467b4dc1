"""The cloud path end to end on an emulated cluster: a real ``spotlight run`` controller with
``SPOTLIGHT_LAUNCHER=sky`` keeps its worker pool as "managed jobs" of ``tests/emulated_cluster.py``
(real local processes of the YAMLs' own ``setup:`` and ``run:`` scripts, their bucket mounts copied from
moto S3, preempted on a schedule replayed from the real spot traces in ``sky/traces``, driven through
SkyPilot's job states with SkyPilot's own recovery decision), against a moto S3 run store.

What it shows: at least 5 preemptions across a trainer and an explorer during a 6-iteration spotlight
run, each one recovered (the worker exits 143, never 0, so no job is SUCCEEDED by a preemption); two
trainers on different emulated GPU types (L4, A10G); the held-out prompts read through a mount (the
controller checks the bucket, the workers the copy); the final policy bit-identical to an undisturbed local run;
every exploration unit recorded exactly once with the clean run's result, and every stage committed
once; each worker launched once and started again once per recovery, never per iteration; a ledger
priced from the resources strings SkyPilot's own function formats (spot at spot prices), with the
provisioning, the controller VM and the S3 requests; and the S3 requests per process per second while
waiting, printed.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import statistics
import subprocess
import time
from collections import Counter
from pathlib import Path

import boto3
import pytest

from spotlight import cost
from spotlight.catalog import vm_rows
from spotlight.data import DIGIT_PROMPTS
from spotlight.forecast.traces import load_traces
from spotlight.pool import read_slot
from spotlight.store import RunStore
from tests.conftest import REPO, SMALL, cli_env, spotlight_cmd
from tests.emulated_cluster import EmulationError, capacity_schedule, load_spec, read_events
from tests.moto_s3 import moto_s3

BUCKET = "spotlight-emulated"
TRACES = REPO / "sky" / "traces" / "aws-v100-1node-2023-04-22"
RECIPE = [*SMALL, "grpo.iterations=6", "exploration.mode=spotlight", "evaluation.every=3",
          "exploration.ranking_every=3", "exploration.candidates_per_prompt=8", "exploration.seeds_per_batch=4",
          "exploration.extra_prompts=2"]
FINAL = "iterations/0005/update"
# The replay: 30 trace minutes per real second. Each job starts at a tick of its zone's trace where its
# next drops come within the first 26 s after launch (recomputed and checked below): early enough to
# fall inside the run on a fast, idle machine (the trainer's second recovery alone outlasts the last
# one), and none after that window, so on a slow, busy machine, where a drop may hit a worker still
# booting, the run cannot livelock. One trainer and one explorer: five preemptions, and fewer
# processes booting at once on a small machine.
# A second trainer runs undisturbed on the other GPU type; the controller's VM is SkyPilot's default for
# sky/controller.yaml (m6i.large, on demand).
COMPRESS, RECOVERY, GRACE, WINDOW = 1800.0, 1.0, 3.0, 26.0
JOBS = {"trainer-0": {"zone": "us-east-1f", "start_tick": 4964, "accelerators": ["L4"]},  # drops at ~10.8 s, ~18.4 s
        "trainer-1": {"zone": "us-west-2b", "start_tick": 3500, "accelerators": ["A10G"]},  # none in the window
        "explorer-0": {"zone": "us-west-2c", "start_tick": 4593}}  # ~9.7 s, ~17.4 s and ~25.0 s
CONTROLLER = {"cluster": "spotlight-ctl", "region": "us-east-1", "instance_type": "m6i.large"}


@pytest.fixture(scope="module")
def moto():
    with moto_s3("AKIAEMULATEDCLUSTER", "emulated+cluster+secret0123456789", BUCKET) as server:
        yield server


def _spec(tmp: Path, **changes) -> Path:
    spec = {"traces": str(TRACES), "compress": COMPRESS, "recovery_seconds": RECOVERY, "grace_seconds": GRACE,
            "provision_seconds": 0.5, "preempt_window_seconds": WINDOW, "logdir": str(tmp / "cluster"), "jobs": JOBS,
            "controller": CONTROLLER, **changes}
    path = tmp / "cluster.json"
    path.write_text(json.dumps(spec))
    return path


def planned_preemptions() -> dict[str, list[float]]:
    traces = load_traces(TRACES)
    return {slot: [s.end for s in capacity_schedule(traces, j["zone"], j["start_tick"], COMPRESS, RECOVERY, WINDOW)
                   if not math.isinf(s.end)] for slot, j in JOBS.items()}


def _queue_records(store: RunStore, prefix: str) -> dict:
    """What a queue's objects say: per item, its units, the recorded units and results, the lease epochs,
    and the done marker."""
    items = store.load(f"{prefix}/items").json("items.json")
    out = {}
    for item in items:
        recorded = {u: store.get_json(f"{prefix}/units/{item['id']}/{u}") for u in store.list(f"{prefix}/units/{item['id']}")}
        leases = store.list(f"{prefix}/leases/{item['id']}")
        out[item["id"]] = {"units": item["units"], "recorded": recorded,
                           "epochs": sorted({int(n.split("-")[0]) for n in leases}),
                           "released": sum(n.endswith("-released") for n in leases),
                           "done": store.get_json(f"{prefix}/done/{item['id']}")}
    return out


def _prompt_folder(folder: Path) -> Path:
    """The digit prompts as a flow_grpo-style prompt folder (what a real run reads from a mounted bucket; the
    tiny model knows only the digit prompts, so the folder holds them, and the run evaluates on them)."""
    folder.mkdir(parents=True)
    for split in ("train", "test"):
        (folder / f"{split}.txt").write_text("\n".join(DIGIT_PROMPTS) + "\n")
    return folder


def test_emulated_cluster_with_real_trace_preemptions_equals_a_clean_local_run(tmp_path, cache_url, moto):
    plan = planned_preemptions()
    print("planned preemptions (s after each job's launch):", {k: [round(x, 1) for x in v] for k, v in plan.items()})
    assert sum(len(v) for v in plan.values()) >= 5 and all(len(plan[s]) >= 2 for s in ("trainer-0", "explorer-0"))

    t0 = time.monotonic()
    clean = tmp_path / "clean"
    local_env = cli_env(tmp_path)
    prompts = _prompt_folder(tmp_path / "prompts" / "digits")
    result = subprocess.run(spotlight_cmd("run", overrides=[*RECIPE, f"run.cache_url={cache_url}", f"run.url=file://{clean}",
                                                            "placement.explorer.workers=0", f"data.eval_prompts={prompts}"]),
                            cwd=tmp_path, env=local_env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    clean_seconds = time.monotonic() - t0

    # the prompts live in a bucket; the workers see it at a path that does not exist on the controller
    s3 = boto3.client("s3")
    for f in prompts.iterdir():
        s3.upload_file(str(f), BUCKET, f"data/digits/{f.name}")
    mounted = tmp_path / "mnt" / "data"
    url = f"s3://{BUCKET}/runs/emulated"
    env = {**local_env, "PYTHONPATH": str(REPO), "SPOTLIGHT_LAUNCHER": "sky",
           "SPOTLIGHT_SKY_JOBS": "tests.emulated_cluster:EmulatedSkyJobs", "EMULATED_CLUSTER": str(_spec(tmp_path)),
           "SPOTLIGHT_POOL_POLL_SECONDS": "0.5",  # the store's own pacing: 0.5 s up to 4 s on S3
           "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(tmp_path / "home"),
           "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": CONTROLLER["cluster"], "cloud": "AWS",
                                                "region": CONTROLLER["region"], "zone": None})}
    placement = ["placement.trainer.workers=2", "placement.explorer.workers=1", "placement.lease_seconds=4",
                 "placement.stall_seconds=20", "placement.trainer.accelerators=[L4:1,A10G:1]",
                 "placement.explorer.accelerators=[A10G:1,L4:1]",
                 f"placement.mounts={{{mounted}: s3://{BUCKET}/data}}", f"data.eval_prompts={mounted}/digits"]
    t0 = time.monotonic()
    proc = subprocess.Popen(spotlight_cmd("run", overrides=[*RECIPE, f"run.cache_url={cache_url}", f"run.url={url}",
                                                            *placement]),
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    emulated_seconds = time.monotonic() - t0
    events = read_events(tmp_path / "cluster")
    assert proc.returncode == 0, out[-5000:] + "\n" + "\n".join(map(json.dumps, events[-20:]))

    # -- the preemptions, SkyPilot's job states, and a pool that launched each worker once -----------
    preempts = [e for e in events if e["event"] == "preempt"]
    starts = Counter(e["slot"] for e in events if e["event"] == "start")
    launches = Counter(e["slot"] for e in events if e["event"] == "launch")
    recoveries = [e for e in events if e["event"] == "recovering"]
    print(f"clean local run {clean_seconds:.0f} s; emulated cloud run {emulated_seconds:.0f} s with "
          f"{len(preempts)} preemptions: " + ", ".join(f"{e['slot']} at +{e['t'] - events[0]['t']:.0f}s" for e in preempts)
          + "; recoveries: " + ", ".join(f"{e['slot']} ({e['how']})" for e in recoveries))
    assert len(preempts) >= 5, f"only {len(preempts)} preemptions happened during the run"
    assert {e["slot"] for e in preempts} >= {"trainer-0", "explorer-0"}
    assert launches == {"trainer-0": 1, "trainer-1": 1, "explorer-0": 1}, "one launch per worker, not per iteration"
    # every preemption is a recovery of the same job (the worker exits 143; an exit 0 would be SUCCEEDED)
    assert Counter(e["slot"] for e in recoveries) == Counter(e["slot"] for e in preempts)
    assert all(e["rc"] == 143 for e in events if e["event"] == "error-exit"), "a preempted worker exits 143"
    assert not [e for e in events if e["event"] in ("exit", "failed") and e.get("preempted")]
    assert starts == {slot: 1 + sum(e["slot"] == slot for e in recoveries) for slot in launches}
    assert sorted(e["slot"] for e in events if e["event"] == "exit") == sorted(launches), \
        "each worker SUCCEEDED (exit 0) when the run was over"
    assert {e["path"] for e in events if e["event"] == "mount"} == {str(mounted)}

    # -- the same policy, bit for bit ------------------------------------------------------------------
    store, ref = RunStore(url), RunStore(f"file://{clean}")
    for obj in ("policy.safetensors", "optimizer.safetensors"):
        assert store.load(FINAL).read(obj) == ref.load(FINAL).read(obj), f"{obj} differs from the clean run"

    # -- every unit recorded once, with the clean run's result; every stage committed once -------------
    reclaimed = released = 0
    for name in store.list("queues"):
        mine, theirs = _queue_records(store, f"queues/{name}"), _queue_records(ref, f"queues/{name}")
        assert mine.keys() == theirs.keys()
        for item, rec in mine.items():
            assert sorted(rec["recorded"]) == sorted(rec["units"]), f"{name}/{item}: a unit was lost"
            results = {u: r["result"] for u, r in rec["recorded"].items()}
            assert rec["done"]["results"] == results, f"{name}/{item}: the done marker disagrees with its units"
            assert {u: r["rewards"] for u, r in results.items()} == \
                {u: r["result"]["rewards"] for u, r in theirs[item]["recorded"].items()}, f"{name}/{item}: other rewards"
            reclaimed += rec["epochs"][-1] > 0
            released += rec["released"]
        t = int(name.removeprefix("explore-"))
        table = store.load(f"iterations/{t:04d}/explore").json("explored.json")
        plan_counts = store.load(f"iterations/{t:04d}/explore").json("plan.json")["counts"]
        assert [len(s) for s in table["seeds"]] == plan_counts and all(len(set(s)) == len(s) for s in table["seeds"])
    stage_names = store.list("stages")
    assert all(n.endswith("-a01") for n in stage_names), f"a stage attempt failed: {stage_names}"
    stage_epochs = {n: sorted({int(x.split("-")[0]) for x in store.list(f"stages/{n}/leases/{n[:-4]}")})
                    for n in stage_names}
    assert all(store.exists(f"stages/{n}/done/{n[:-4]}") for n in stage_names)
    done_by = Counter(store.get_json(f"stages/{n}/done/{n[:-4]}")["worker"].rsplit("_", 1)[0] for n in stage_names)
    print(f"exploration items re-claimed after a preemption: {reclaimed}, released on SIGTERM: {released}; "
          f"stages claimed again: {[n for n, e in stage_epochs.items() if e[-1] > 0]}; stages done by: {dict(done_by)}")

    # -- two trainers, two GPU types; the ledger from SkyPilot's strings, spot at spot prices -------------
    slots = {kind: read_slot(store, next(n for n in launches_names(events) if n.endswith(kind)))
             for kind in ("trainer-0000", "trainer-0001", "explorer-0000")}
    assert {k: list(s["resources"]["accelerators"]) for k, s in slots.items() if k.startswith("trainer")} == \
        {"trainer-0000": ["L4"], "trainer-0001": ["A10G"]}
    for kind, slot in slots.items():
        res = slot["resources"]
        rows = [r for r in vm_rows("aws") if (r["InstanceType"], r["Region"]) == (res["instance_type"], res["region"])]
        spot = statistics.median(float(r["SpotPrice"]) for r in rows)  # zone names are per account: the median
        assert res["use_spot"] and slot["price_per_hour"] == pytest.approx(spot), \
            f"{kind}: {slot['price_per_hour']} is not the spot price of {res['instance_type']} in {res['region']}"
        assert slot["price_per_hour"] < float(rows[0]["Price"])
    entries = cost.ledger(store)
    work = [e for e in entries if e["stage"] in ("pretrain", "update", "evaluate", "ranking", "explore")]
    assert work and all(e["price_per_hour"] > 0 and e["instance"].startswith("AWS/") and "[spot]" in e["instance"]
                        for e in work), [(e["stage"], e["instance"], e["price_per_hour"]) for e in work][:5]
    assert {e["iteration"] for e in work if e["stage"] == "update" and e["outcome"] == "ok"} == set(range(6))
    provision = [e for e in entries if e["stage"] == "provision"]
    assert Counter(e["worker"].rsplit("-", 2)[-2] + "-" + str(int(e["worker"][-4:])) for e in provision) == \
        {slot: 1 + sum(e["slot"] == slot for e in recoveries) for slot in launches}, "one entry per launch and recovery"
    controller = [e for e in entries if e["stage"] == "controller"]
    m6i = next(float(r["Price"]) for r in vm_rows("aws") if (r["InstanceType"], r["Region"]) == ("m6i.large", "us-east-1"))
    assert controller and all(e["price_per_hour"] == m6i for e in controller)
    pool_life = max(e["t"] for e in events if e["event"] == "exit") - min(e["t"] for e in events if e["event"] == "launch")
    assert sum(e["seconds"] for e in controller) >= pool_life, "the controller is billed from its boot to the pool's end"
    boots = [e for e in entries if e["stage"] == "boot"]
    assert boots and all(e["setup_seconds"] > 0 for e in boots), "setup (pip install) is paid for in the boot entry"
    by_stage = cost.by_stage(entries)
    assert by_stage["s3-requests"]["attempts"] > 0 and by_stage["s3-requests"]["cost_usd"] > 0
    preempted = [e for e in entries if e.get("outcome") == "preempted"]
    print(f"ledger: {len(entries)} entries, ${cost.total(store):.4f}: " + ", ".join(
        f"{stage} ${row['cost_usd']:.5f}" for stage, row in sorted(by_stage.items())) + "; preempted attempts: "
        + ", ".join(f"{e['stage']}-{e['iteration']} {e['seconds']:.1f}s" for e in preempted))
    waiting = cost.requests_per_second_waiting(entries)
    idle = Counter()
    for e in entries:
        idle[e.get("worker") or e["stage"]] += e.get("waiting_seconds", 0)
    label = {who: (m.group(0) if (m := re.search(r"(trainer|explorer)-\d{4}", who)) else who) for who in waiting}
    print("S3 requests per process per second while waiting (waits of seconds, full of changes: see docs/cloud.md): "
          + ", ".join(f"{label[who]} {rate:.2f} over {idle[who]:.0f} s" for who, rate in sorted(waiting.items())))
    assert set(waiting) >= {"controller"} and len(waiting) == 4
    summary = json.loads(store.read_bytes("report/summary.json"))
    assert summary["cost_usd"] == pytest.approx(cost.total(store)) and summary["cost_by_stage"]["update"]["attempts"] >= 6


def launches_names(events: list[dict]) -> list[str]:
    return sorted({e["job"] for e in events if e["event"] == "launch"})


def test_emulated_cluster_bad_traces_fail_at_once_naming_them(tmp_path):
    with pytest.raises(EmulationError, match="no such folder"):
        load_spec(_spec(tmp_path, traces=str(tmp_path / "nowhere")))
    broken = tmp_path / "traces"
    broken.mkdir()
    for p in TRACES.glob("*.json"):
        (broken / p.name).write_text(p.read_text())
    (broken / "us-west-2b_v100_1.json").write_text('{"metadata": {"gap_seconds": 32}, "data": [1, 1, "x"]}')
    with pytest.raises(EmulationError, match=r"us-west-2b_v100_1.json: data\[2\] = 'x'"):
        load_spec(_spec(tmp_path, traces=str(broken)))
    (broken / "us-west-2b_v100_1.json").unlink()
    (broken / "us-west-2c_v100_1.json").unlink()  # the explorer's zone (us-west-2b: the second trainer's)
    with pytest.raises(EmulationError, match="no spot trace for zone.s. us-west-2b, us-west-2c in"):
        load_spec(_spec(tmp_path, traces=str(broken)))
    with pytest.raises(EmulationError, match="no such file"):
        load_spec(tmp_path / "missing.json")
    with pytest.raises(EmulationError, match="start_tick 99999 is outside the trace of us-west-2b"):
        capacity_schedule(load_traces(TRACES), "us-west-2b", 99999, COMPRESS, RECOVERY, WINDOW)
    with pytest.raises(EmulationError, match="no spot trace for zone 'eu-north-1a'"):
        capacity_schedule(load_traces(TRACES), "eu-north-1a", 0, COMPRESS, RECOVERY, WINDOW)
