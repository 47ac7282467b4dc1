"""The worker pool's launcher at the SkyPilot boundary: only ``SkyJobs.records`` (the call into sky.jobs) is
replaced, by records of SkyPilot's shape (statuses as SkyPilot's ``ManagedJobStatus`` values, resources
strings made by SkyPilot's own formatting function, ``tests/sky_records.py``).

Everything else is real: the worker YAML is parsed by ``sky.Task.from_yaml_config`` with the run's
placement as its resources and its mounts, envs and secrets are filled in on a real ``sky.Task``, names
are derived, an active job is found instead of launched twice, an ended job is relaunched, a job that
keeps failing breaks the pool naming it (status, failure reason, log tail, no secret), the job's
resources are priced from the catalog for the ledger (spot at spot prices, every node), and the time
SkyPilot spent provisioning it is billed once.
"""

from __future__ import annotations

import csv
import datetime
import json
import os
import time
from pathlib import Path

import boto3
import pytest

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

from spotlight import cost, stage_queue  # noqa: E402
from spotlight.config import load_config  # noqa: E402
from spotlight.pool import mark_pool_done, pool_broken, write_slot  # noqa: E402
from spotlight.store import RunStore  # noqa: E402
import sky  # noqa: E402

from tasks.launcher import (LocalLauncher, SkyJobs, SkyLauncher, check_api_server, controller_job_group,  # noqa: E402
                            job_name, launcher_from_env, parse_resources, run_prefix, sky_jobs_from_env)
from tasks.sky_task import placement_resources  # noqa: E402
from tasks.workers import SkyPool  # noqa: E402
from tests.moto_s3 import moto_s3  # noqa: E402
from tests.sky_records import resources_strings  # noqa: E402

SECRET = "fakeSECRETkey/for+launcher+tests0123456789"
ENV = {"AWS_ACCESS_KEY_ID": "AKIALAUNCHERTEST", "AWS_SECRET_ACCESS_KEY": SECRET}
RUN = "s3://bucket/runs/exp1"
REPO = Path(__file__).resolve().parents[1]


def _config(url: str = RUN, *sets: str) -> dict:
    return load_config("configs/tiny.yaml", [f"run.url={url}", "grpo.iterations=3", *sets]).model_dump(mode="json")


class FakeSkyJobs(SkyJobs):
    """Stands in for SkyPilot's jobs controller: its records stay as the test sets them."""

    def __init__(self, existing: list[dict] | None = None, logs: str = ""):
        self.recorded, self.log_text = list(existing or []), logs
        self.launched: list[tuple[object, str]] = []
        self.cancelled: list[str] = []

    def launch(self, task, name):
        self.launched.append((task, name))
        job_id = max([r["job_id"] for r in self.recorded], default=0) + 1
        self.recorded.append({"job_id": job_id, "job_name": name, "status": "PENDING", "recovery_count": 0,
                              "failure_reason": None, "cloud": None})
        return job_id

    def records(self, name_match):
        return [dict(r) for r in self.recorded if name_match in r["job_name"]]

    def job_record(self, job_id):
        return next((dict(r) for r in self.recorded if r["job_id"] == job_id), None)

    def cancel(self, name):
        self.cancelled.append(name)
        for r in self.recorded:
            if r["job_name"] == name and r["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                r["status"] = "CANCELLED"

    def logs(self, job_id, tail):
        return "\n".join(self.log_text.splitlines()[-tail:])

    def set(self, name, **fields):
        record = max((r for r in self.recorded if r["job_name"] == name), key=lambda r: r["job_id"])
        record.update(fields)


def _launcher(jobs: FakeSkyJobs) -> SkyLauncher:
    return SkyLauncher(jobs=jobs, poll_seconds=0, log_tail_lines=3, environ=ENV)


def test_worker_task_is_the_yaml_with_the_placement_resources_and_the_run_envs():
    config = _config(RUN, "placement.trainer.accelerators=[H100:8,A100-80GB:8]", "placement.trainer.use_spot=false",
                     "placement.trainer.cpus=32+", "placement.idle_exit_seconds=900")
    jobs = FakeSkyJobs()
    name, job_id = _launcher(jobs).start("trainer", 0, config)
    [(task, launched)] = jobs.launched
    assert launched == name == job_name(RUN, "trainer", 0) and name.endswith("-trainer-0000") and job_id == 1
    assert name == job_name(RUN + "/", "trainer", 0) and job_name("s3://other/runs/exp1", "trainer", 0) != name
    assert task.name == "spotlight-trainer"
    assert {(next(iter(r.accelerators.items())), r.use_spot, r.cpus) for r in task.resources} == \
        {(("H100", 8), False, "32+"), (("A100-80GB", 8), False, "32+")}
    assert all(r.job_recovery["strategy"] == "EAGER_NEXT_REGION" for r in task.resources)  # the YAML's, kept
    assert task.envs["RUN_URL"] == RUN and task.envs["SPOTLIGHT_SLOT"] == name and task.envs["IDLE_EXIT"] == "900"
    secrets = {k: v.get_secret_value() for k, v in task.secrets.items()}  # SkyPilot keeps them as SecretStr
    assert secrets["AWS_SECRET_ACCESS_KEY"] == SECRET and not task.managed_secret_refs
    assert SECRET not in repr(task.secrets) and SECRET not in str(task.envs)
    assert "spotlight worker --kind trainer" in task.run and task.workdir == str(REPO)
    assert not task.storage_mounts and "HF_HOME" not in task.envs
    one = placement_resources({"job_recovery": {"strategy": "EAGER_NEXT_REGION"}},
                              load_config(None, ["placement.explorer.accelerators=[L4:1]"]).placement.explorer)
    assert one == {"job_recovery": {"strategy": "EAGER_NEXT_REGION"}, "use_spot": True, "disk_size": 100,
                   "accelerators": "L4:1"}


def test_mounts_and_the_cache_bucket_reach_every_worker_task_as_skypilot_storage():
    config = _config(RUN, "placement.mounts={/models: s3://weights/models, /data/prompts: {source: s3://weights/p, "
                     "mode: COPY}}", "placement.cache=s3://weights/cache")
    jobs = FakeSkyJobs()
    for kind in ("trainer", "explorer"):
        _launcher(jobs).start(kind, 0, config)
    for task, _ in jobs.launched:  # SkyPilot's own Storage objects, made by its parser
        mounts = {path: (s.source, s.mode.value) for path, s in task.storage_mounts.items()}
        assert mounts == {"/models": ("s3://weights/models", "MOUNT_CACHED"), "/data/prompts": ("s3://weights/p", "COPY"),
                          "/spotlight-cache": ("s3://weights/cache", "MOUNT_CACHED")}
        assert task.envs["TORCHINDUCTOR_CACHE_DIR"].startswith("/spotlight-cache/") and task.envs["RUN_URL"] == RUN
    with pytest.raises(Exception, match="not a bucket URL"):
        _config(RUN, "placement.mounts={/models: /home/me/models}")


def test_a_sequence_parallel_explorer_gets_its_degree_and_a_node_of_that_many_gpus():
    sp = ["placement.sequence_parallel.degree=4", "model.pretrained=/models/FLUX.1-dev"]
    config = load_config("configs/flux-dev-ocr.yaml", [f"run.url={RUN}", *sp,
                                                       "placement.explorer.accelerators=[H100:4,A100-80GB:4]"])
    jobs = FakeSkyJobs()
    _launcher(jobs).start("explorer", 0, config.model_dump(mode="json"))
    [(task, _)] = jobs.launched
    assert task.envs["SP_DEGREE"] == "4" and {next(iter(r.accelerators.items())) for r in task.resources} == \
        {("H100", 4), ("A100-80GB", 4)}
    one_gpu = load_config("configs/flux-dev-ocr.yaml", [f"run.url={RUN}", *sp]).model_dump(mode="json")
    with pytest.raises(ValueError, match=r"do not have 4 GPUs each .* one member per GPU"):
        _launcher(FakeSkyJobs()).start("explorer", 0, one_gpu)
    _launcher(jobs).start("trainer", 0, one_gpu)  # the trainer's own rollouts are not sequence-parallel


def test_pool_launches_each_worker_once_finds_active_ones_and_relaunches_ended_ones(tmp_path):
    url = f"file://{tmp_path}/run"  # the pool's markers; the launcher itself is told the bucket URL below
    cfg = load_config("configs/tiny.yaml", [f"run.url={RUN}", "placement.explorer.workers=2"])
    pool = SkyPool(cfg, _launcher(FakeSkyJobs()), close_grace_seconds=0)
    pool.store = RunStore(url)
    # a previous controller's trainer is still running: it is the trainer, not launched again
    jobs = pool.launcher.jobs
    jobs.recorded.append({"job_id": 7, "job_name": job_name(RUN, "trainer", 0), "status": "RECOVERING",
                          "recovery_count": 2, "failure_reason": None, "cloud": None})
    pool.start()
    assert sorted(n for _, n in jobs.launched) == sorted([job_name(RUN, "explorer", 0), job_name(RUN, "explorer", 1)])
    for _ in range(5):  # polls while everything runs launch nothing
        pool.keep()
    assert len(jobs.launched) == 2
    # the explorer's job exits 0 (it idled out) while the run goes on: launched again, no failure counted
    jobs.set(job_name(RUN, "explorer", 1), status="SUCCEEDED")
    pool.keep()
    assert [n for _, n in jobs.launched][-1] == job_name(RUN, "explorer", 1) and not pool.failures
    # once the flow is over, an ended job stays ended; close cancels what still runs
    mark_pool_done(pool.store, "test")
    jobs.set(job_name(RUN, "explorer", 0), status="FAILED")
    pool.keep()
    assert len(jobs.launched) == 3
    pool.close()
    assert sorted(jobs.cancelled) == sorted([job_name(RUN, "trainer", 0), job_name(RUN, "explorer", 1)])


def test_a_worker_that_keeps_failing_breaks_the_pool_naming_it(tmp_path):
    log = "\n".join([f"line {i}" for i in range(10)] + [f"botocore says key {SECRET} was rejected", "Traceback: boom"])
    cfg = load_config("configs/tiny.yaml", [f"run.url={RUN}", "placement.max_relaunches=1", "exploration.mode=none"])
    jobs = FakeSkyJobs(logs=log)
    pool = SkyPool(cfg, _launcher(jobs), close_grace_seconds=0)
    pool.store = RunStore(f"file://{tmp_path}/run")
    pool.start()
    name = job_name(RUN, "trainer", 0)
    assert [n for _, n in jobs.launched] == [name]  # mode none: no explorers
    jobs.set(name, status="FAILED_SETUP", failure_reason="pip install failed")
    pool.keep()  # one relaunch allowed
    jobs.set(name, status="FAILED_SETUP", failure_reason="pip install failed")
    pool.keep()
    assert len(jobs.launched) == 2
    broken = pool_broken(pool.store)
    assert broken["slot"] == name and "ended 2 times" in broken["reason"] and "FAILED_SETUP" in broken["reason"]
    assert "pip install failed" in broken["reason"] and "Traceback: boom" in broken["reason"]
    assert SECRET not in broken["reason"] and "***" in broken["reason"]
    request = stage_queue.post(pool.store, "update", 0, 30)
    with pytest.raises(stage_queue.StageFailed, match=f"worker pool is broken: the trainer {name} ended 2 times"):
        stage_queue.wait(request, poll_seconds=0.01)


@pytest.fixture(scope="module")
def sky_strings() -> dict[str, str]:
    """Resources strings as SkyPilot formats them for launched clusters (one subprocess, private home)."""
    specs = {"spot": dict(cloud="AWS", region="us-east-1", zone="us-east-1a", instance_type="g6.xlarge",
                          accelerators="L4:1", use_spot=True),
             "on-demand": dict(cloud="AWS", region="us-east-1", zone="us-east-1a", instance_type="g6.xlarge",
                               accelerators="L4:1", use_spot=False),
             "two nodes": dict(cloud="AWS", region="us-west-2", zone=None, instance_type="g5.xlarge",
                               accelerators="A10G:1", use_spot=True, nodes=2),
             "controller": dict(cloud="AWS", region="us-east-1", zone=None, instance_type="m6i.large",
                                accelerators=None, use_spot=False, disk_size=256)}
    return dict(zip(specs, resources_strings(list(specs.values()))))


def _catalog(instance: str, region: str) -> list[dict[str, str]]:
    with open(cost.CATALOG_DIR / "aws" / "vms.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if (r["InstanceType"], r["Region"]) == (instance, region)]


def test_job_resources_are_priced_from_skypilots_own_strings_spot_at_spot_prices(tmp_path, sky_strings):
    assert sky_strings["spot"] == "1x[spot](gpus=L4:1, cpus=4, mem=16, g6.xlarge, disk=100)"  # SkyPilot's own
    record = {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a", "accelerators": {"L4": 1},
              "cluster_resources_full": sky_strings["spot"]}
    resources = parse_resources(record)
    assert resources == {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a", "instance_type": "g6.xlarge",
                         "accelerators": {"L4": 1}, "use_spot": True, "nodes": 1}
    rows = _catalog("g6.xlarge", "us-east-1")
    spot = sorted(float(r["SpotPrice"]) for r in rows)  # AWS names zones per account: the region's median
    priced = cost.resources_price(resources)
    assert priced["price_per_hour"] == pytest.approx(spot[len(spot) // 2] if len(spot) % 2 else
                                                     (spot[len(spot) // 2 - 1] + spot[len(spot) // 2]) / 2)
    assert priced["price_per_hour"] < 0.5 * float(rows[0]["Price"]), "spot is billed at spot prices"
    assert priced["instance"] == "AWS/us-east-1/us-east-1a g6.xlarge [spot]"
    on_demand = parse_resources({**record, "cluster_resources_full": sky_strings["on-demand"]})
    assert on_demand["use_spot"] is False and cost.resources_price(on_demand)["price_per_hour"] == float(rows[0]["Price"])
    two = parse_resources({"cloud": "AWS", "region": "us-west-2", "zone": None, "accelerators": {"A10G": 1},
                           "cluster_resources_full": sky_strings["two nodes"]})
    assert two["nodes"] == 2 and two["use_spot"] and two["instance_type"] == "g5.xlarge"
    one_node = cost.resources_price({**two, "nodes": 1})["price_per_hour"]
    assert cost.resources_price(two)["price_per_hour"] == pytest.approx(2 * one_node)
    controller = parse_resources({"cloud": "AWS", "region": "us-east-1", "zone": None,
                                  "resources_str_full": sky_strings["controller"]})  # sky.status's field
    assert controller["instance_type"] == "m6i.large" and not controller["use_spot"]
    assert cost.resources_price(controller)["price_per_hour"] == float(_catalog("m6i.large", "us-east-1")[0]["Price"])
    # the controller as a managed job (`sky jobs launch -n spotlight-ctl`): priced from its job's record
    ctl = FakeSkyJobs([{"job_id": 17, "job_name": "spotlight-ctl", "status": "RUNNING", "cloud": "AWS",
                        "region": "us-east-1", "zone": None, "cluster_resources_full": sky_strings["controller"]}])
    inside = {"SKYPILOT_MANAGED_JOB_ID": "17", "SKYPILOT_CLUSTER_INFO": '{"cluster_name": "spotlight-ctl-17"}'}
    priced_ctl = SkyLauncher(jobs=ctl, poll_seconds=0, environ={**ENV, **inside}).controller_instance()
    assert priced_ctl["price_per_hour"] == float(_catalog("m6i.large", "us-east-1")[0]["Price"])
    assert parse_resources({"cloud": None}) is None and parse_resources({"cloud": "AWS", "cluster_resources_full": "-"}) is None
    with pytest.raises(ValueError, match="is not in the form resources_utils.get_readable_resources_repr writes"):
        parse_resources({**record, "cluster_resources_full": "spot, g6.xlarge"})
    with pytest.raises(cost.PriceError, match="no instance 'g9.mega' in region 'us-east-1'"):
        cost.resources_price({**resources, "instance_type": "g9.mega"})
    # the worker side: its slot's record if it still runs there, else the accelerator where it runs now
    store = RunStore(f"file://{tmp_path}/run")
    write_slot(store, "w", {"resources": resources, **priced})
    here = {"SKYPILOT_CLUSTER_INFO": '{"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a"}'}
    assert cost.worker_instance(store, "explorer", 0.0, "w", here)["price_per_hour"] == priced["price_per_hour"]
    moved = cost.worker_instance(store, "explorer", 0.0, "w", {"SKYPILOT_CLUSTER_INFO":
                                                                '{"cloud": "AWS", "region": "us-west-2", "zone": "usw2-az1"}'})
    assert moved["instance"].startswith("AWS/us-west-2") and moved["price_per_hour"] > 0
    local = cost.worker_instance(store, "trainer", 1.25, None, {})
    assert local["price_per_hour"] == 1.25 and local["price_source"] == "placement.trainer.price_per_hour"


def test_pool_bills_provisioning_from_the_job_record_once_per_recovery(tmp_path, sky_strings):
    """SkyPilot's record: ``last_recovered_at - submitted_at - job_duration`` is the time the job was not
    running; each stretch is one ledger entry, never two however often the pool (or a new pool) looks."""
    cfg = load_config("configs/tiny.yaml", [f"run.url={RUN}", "exploration.mode=none"])
    jobs = FakeSkyJobs()
    pool = SkyPool(cfg, _launcher(jobs), close_grace_seconds=0)
    pool.store = RunStore(f"file://{tmp_path}/run")
    pool.start()
    name = job_name(RUN, "trainer", 0)
    where = {"cloud": "AWS", "region": "us-east-1", "zone": "us-east-1a", "accelerators": {"L4": 1},
             "cluster_resources_full": sky_strings["spot"]}
    jobs.set(name, status="STARTING", submitted_at=1000.0, **where)
    pool.keep()  # provisioning: nothing finished yet
    assert not [e for e in cost.ledger(pool.store) if e["stage"] == "provision"]
    jobs.set(name, status="RUNNING", start_at=1180.0, last_recovered_at=1180.0, job_duration=0.0)
    pool.keep()
    pool.keep()
    # preempted at 1900 (SkyPilot adds 720 s of running to job_duration), running again at 2200 elsewhere
    jobs.set(name, status="RECOVERING", job_duration=720.0)
    pool.keep()
    jobs.set(name, status="RUNNING", last_recovered_at=2200.0, recovery_count=1)
    again = SkyPool(cfg, _launcher(jobs), close_grace_seconds=0)
    again.store = pool.store
    for p in (pool, again):
        p.keep()
    entries = [e for e in cost.ledger(pool.store) if e["stage"] == "provision"]
    price = cost.resources_price(parse_resources(where))["price_per_hour"]
    assert [(e["recovery_count"], e["seconds"]) for e in entries] == [(0, 180.0), (1, 300.0)]
    assert all(e["price_per_hour"] == price and e["worker"] == name for e in entries)
    assert cost.total(pool.store) == pytest.approx(480.0 / 3600 * price)


def test_clear_errors_before_anything_is_launched():
    jobs = FakeSkyJobs()
    with pytest.raises(ValueError, match="needs a bucket run store"):
        _launcher(jobs).start("trainer", 0, _config("file:///tmp/runs/x"))
    with pytest.raises(ValueError, match="no SkyPilot task for worker kind 'updater'"):
        _launcher(jobs).start("updater", 0, _config())
    assert jobs.launched == [] and jobs.cancelled == []


def test_cancel_run_cancels_only_active_jobs_of_the_run():
    other = job_name("s3://bucket/runs/exp2", "trainer", 0)
    jobs = FakeSkyJobs([
        {"job_id": 1, "job_name": job_name(RUN, "trainer", 0), "status": "SUCCEEDED"},
        {"job_id": 2, "job_name": job_name(RUN, "trainer", 0), "status": "RECOVERING"},
        {"job_id": 3, "job_name": job_name(RUN, "explorer", 2), "status": "RUNNING"},
        {"job_id": 4, "job_name": other, "status": "RUNNING"}])
    assert _launcher(jobs).cancel_run(RUN) == sorted([job_name(RUN, "trainer", 0), job_name(RUN, "explorer", 2)])
    assert other not in jobs.cancelled


def test_launcher_from_env():
    assert isinstance(launcher_from_env({}), LocalLauncher)
    sky = launcher_from_env({"SPOTLIGHT_LAUNCHER": "sky", "SPOTLIGHT_POOL_POLL_SECONDS": "2"})
    assert isinstance(sky, SkyLauncher) and type(sky.jobs) is SkyJobs and sky.poll_seconds == 2
    assert type(sky_jobs_from_env({"SPOTLIGHT_SKY_JOBS": "tests.test_launcher:FakeSkyJobs"})).__name__ == "FakeSkyJobs"
    with pytest.raises(ValueError, match="expected module:attribute"):
        sky_jobs_from_env({"SPOTLIGHT_SKY_JOBS": "tests.test_launcher"})
    with pytest.raises(ValueError, match="expected 'local' or 'sky'"):
        launcher_from_env({"SPOTLIGHT_LAUNCHER": "k8s"})


def test_the_pool_owns_error_restarts_so_one_failing_worker_boots_at_most_max_relaunches_plus_one(tmp_path):
    """A trainer that crashes at once, on the emulated cluster (tests/emulated_cluster.py: SkyPilot's
    max_restarts_on_errors played out on real processes). Launched by hand with the YAML's job_recovery, one
    job boots 1 + 3 times; the pool's jobs boot once each, so with max_relaunches 3 the worker boots 4 times,
    not (1 + 3) x (1 + 3) = 16."""
    from tests.emulated_cluster import EmulatedSkyJobs, read_events
    from tests.jobs_api import status

    sky_dir = tmp_path / "sky"
    sky_dir.mkdir()
    for path in (REPO / "sky").glob("*.yaml"):  # the real YAMLs, the trainer's run crashing first thing
        text = path.read_text()
        (sky_dir / path.name).write_text(text.replace("run: |\n", "run: |\n  echo 'boom'; exit 3\n")
                                         if path.name == "trainer.yaml" else text)
    logdir = tmp_path / "cluster"
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"traces": str(REPO / "sky/traces/aws-v100-1node-2023-04-22"), "compress": 1.0,
                                "recovery_seconds": 0.0, "grace_seconds": 1.0, "preempt_window_seconds": 0.0,
                                "logdir": str(logdir),  # capacity at once, and no preemption
                                "jobs": {"trainer-0": {"zone": "us-east-1f", "start_tick": 4964}}}))
    jobs = EmulatedSkyJobs(str(spec))
    cfg = load_config("configs/tiny.yaml", [f"run.url={RUN}", "placement.max_relaunches=3", "exploration.mode=none"])
    launcher = SkyLauncher(jobs=jobs, sky_dir=sky_dir, poll_seconds=0, log_tail_lines=3, environ=ENV)

    def boots(name: str) -> int:
        return sum(e["event"] == "start" and e["job"] == name for e in read_events(logdir))

    def ended(name: str) -> bool:
        record = launcher.latest(name)
        return record is not None and status(record) in ("FAILED", "SUCCEEDED", "CANCELLED")

    def wait(condition, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, read_events(logdir)[-5:]
            time.sleep(0.05)

    by_hand = f"{run_prefix(RUN)}by-hand-trainer-0000"  # `sky jobs launch sky/trainer.yaml`: the YAML as written
    jobs.launch(sky.Task.from_yaml(str(sky_dir / "trainer.yaml")), by_hand)
    wait(lambda: ended(by_hand))
    assert boots(by_hand) == 1 + 3 and status(launcher.latest(by_hand)) == "FAILED"

    pool = SkyPool(cfg, launcher, close_grace_seconds=0)
    pool.store = RunStore(f"file://{tmp_path}/run")
    pool.start()
    name = job_name(RUN, "trainer", 0)
    while pool_broken(pool.store) is None:
        wait(lambda: ended(name))
        pool.keep()
    assert boots(name) == 1 + cfg.placement.max_relaunches  # 4, one per job
    assert [n for n in launcher.launched] == [name] * 4 and pool.failures[name] == 4
    reason = pool_broken(pool.store)["reason"]
    assert f"the trainer {name} ended 4 times (placement.max_relaunches is 3)" in reason and "boom" in reason


def test_workers_join_the_controllers_job_group_when_launched_from_its_managed_job():
    """SkyPilot's own resolver reads what the launcher passes as ``job_group``: inside the controller's
    managed job, the controller's id (its workers are cancelled with it); elsewhere, a top-level job."""
    import inspect

    from sky.jobs.client.sdk import _resolve_job_group
    from sky.server.constants import MIN_JOBS_PARENT_LINK_API_VERSION

    inside = {"SKYPILOT_MANAGED_JOB_ID": "17", "SKYPILOT_TASK_ID": "sky-managed-2026_spotlight-ctl_17-0"}
    group = controller_job_group(inside, api_version=MIN_JOBS_PARENT_LINK_API_VERSION)
    assert group == 17 and _resolve_job_group(group).parent_job_id == 17
    inspect.signature(sky.jobs.launch).bind(sky.Task(run="true"), name="w", job_group=group)  # a real argument
    assert controller_job_group({}, api_version=MIN_JOBS_PARENT_LINK_API_VERSION) is None
    assert not _resolve_job_group(None).attaches
    assert controller_job_group(inside, api_version=MIN_JOBS_PARENT_LINK_API_VERSION - 1) is None  # an older server


def test_on_the_controller_vm_the_api_server_must_be_the_users():
    inside = {"SKYPILOT_MANAGED_JOB_ID": "17"}
    with pytest.raises(RuntimeError, match="set SKYPILOT_API_SERVER_ENDPOINT to your remote API server"):
        check_api_server({**inside, "SKYPILOT_API_SERVER_ENDPOINT": "http://127.0.0.1:46580"})
    check_api_server({**inside, "SKYPILOT_API_SERVER_ENDPOINT": "https://skypilot.example.com"})
    check_api_server({})  # not in a managed job (a laptop): whatever SkyPilot is configured with


def test_session_tokens_are_passed_and_their_expiry_is_checked(caplog):
    token = "FwoGZXIvYXdzEXAMPLEsessionTOKEN0123456789"
    now = datetime.datetime.now(datetime.timezone.utc)
    soon = {**ENV, "AWS_SESSION_TOKEN": token, "AWS_CREDENTIAL_EXPIRATION": (now + datetime.timedelta(minutes=5)).isoformat()}
    jobs = FakeSkyJobs()
    with pytest.raises(RuntimeError, match=r"the AWS session token expires at .* in [45] min"):
        SkyLauncher(jobs=jobs, poll_seconds=0, environ=soon).start("trainer", 0, _config())
    assert jobs.launched == []
    later = {**soon, "AWS_CREDENTIAL_EXPIRATION": (now + datetime.timedelta(hours=3)).isoformat().replace("+00:00", "Z")}
    with caplog.at_level("WARNING"):
        SkyLauncher(jobs=jobs, poll_seconds=0, environ=later).start("trainer", 0, _config())
    [(task, _)] = jobs.launched
    assert task.secrets["AWS_SESSION_TOKEN"].get_secret_value() == token
    assert "expire at" in caplog.text and "(in 3.0 h)" in caplog.text and token not in caplog.text
    # the pool's jobs leave error restarts to the pool; the rest of the YAML's job_recovery stays
    assert all(r.job_recovery == {"strategy": "EAGER_NEXT_REGION", "max_restarts_on_errors": 0,
                                  "recover_on_exit_codes": [143]} for r in task.resources)
    with pytest.raises(ValueError, match="AWS_CREDENTIAL_EXPIRATION='tomorrow' is not an ISO 8601 time"):
        SkyLauncher(jobs=jobs, poll_seconds=0, environ={**soon, "AWS_CREDENTIAL_EXPIRATION": "tomorrow"}).secrets()


@pytest.fixture
def bucket():
    """A moto S3 server, reached the way the controller reaches a bucket: by env (the standard chain)."""
    with moto_s3("AKIAMOUNTS", "mounts-secret", "weights"):
        yield boto3.client("s3")


def test_the_controller_checks_mounted_inputs_in_their_buckets_and_a_worker_at_its_paths(bucket, tmp_path):
    """The controller has no mounts: it checks what the workers will see in the buckets (fsspec), with the
    workers' own checks, and names the URL; a worker checks the paths it mounted, and names the bucket."""
    from spotlight.config import ConfigError
    from spotlight.mounts import check_mounted_inputs
    from spotlight.worker import check_worker_inputs

    mounted = tmp_path / "mnt" / "prompts"  # does not exist here: only a worker would have it
    sets = [f"placement.mounts={{{mounted}: s3://weights/prompts}}", f"data.eval_prompts={mounted}/digits"]
    cfg = load_config("configs/tiny.yaml", [f"run.url={RUN}", *sets])
    bucket.put_object(Bucket="weights", Key="prompts/digits/train.txt", Body=b"a handwritten digit 1\n")
    with pytest.raises(ConfigError, match=r"s3://weights/prompts/digits has no test.txt, test_metadata.jsonl"):
        check_mounted_inputs(cfg)  # the prompt folder lacks its test split
    bucket.put_object(Bucket="weights", Key="prompts/digits/test.txt", Body=b"a handwritten digit 1\n")
    check_mounted_inputs(cfg)  # now it reads from the bucket, though the path is on no disk here
    with pytest.raises(ConfigError, match=r"data.eval_prompts: s3://weights/prompts/elsewhere does not exist"):
        check_mounted_inputs(load_config("configs/tiny.yaml", [f"run.url={RUN}", sets[0],
                                                               f"data.eval_prompts={mounted}/elsewhere"]))
    local = tmp_path / "prompts"  # a path on the controller's disk only: no cloud worker sees it
    with pytest.raises(ConfigError, match=f"these inputs are on this machine only:\n  data.eval_prompts: {local}"):
        check_mounted_inputs(load_config("configs/tiny.yaml", [f"run.url={RUN}", f"data.eval_prompts={local}"]))
    # the worker, after mounting: a path that is not there fails naming it and the bucket behind it
    with pytest.raises(ConfigError, match=rf"(?s){mounted}/digits.*is s3://weights/prompts/digits, mounted by placement"):
        check_worker_inputs(cfg)
