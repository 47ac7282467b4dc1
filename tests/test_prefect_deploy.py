"""`prefect deploy` as users run it: a real local server, a process work pool, a worker, the UI in Chromium.

One server and one deployed run (plus its resumed re-run) are shared by the module's tests:
- the on-demand deployment runs the flow to Completed with its artifacts, from this clone;
- re-running it on the same run URL recomputes nothing (commit manifests keep their mtimes);
- the scheduled deployment carries its cron schedule;
- the UI (headless Debian Chromium) shows the run's name, its Completed state and its artifacts.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import boto3
import pytest
import sky
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
from prefect.client.schemas.objects import Artifact, FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_server import PrefectServer, prefect_server, stop_process_group
from spotlight import cost
from spotlight.pool import pool_done
from spotlight.store import RunStore
from tasks.artifacts import artifact_key, cost_so_far
from tasks.launcher import run_prefix
from tests.conftest import SMALL
from tests.jobs_api import JobsApi, jobs_api, status
from tests.moto_s3 import Moto

REPO = Path(__file__).resolve().parents[1]
UI_OUT = REPO / "out" / "prefect-ui"  # screenshots and DOM dumps of the UI check (git-ignored)
CHROMIUM = "/usr/bin/chromium"
RUN_NAME = "deploy-test"
OVERRIDES = [
    f"run.name={RUN_NAME}", "pretrain.steps=40", "pretrain.classifier_steps=40", "grpo.iterations=2",
    "evaluation.seeds_per_prompt=2", "evaluation.every=1", "grpo.prompts_per_iteration=2", "grpo.group_size=4",
    "sampler.train_steps=6", "sampler.eval_steps=6",
]


@dataclass
class DeployedRun:
    server: PrefectServer
    run_dir: Path
    first: FlowRun
    second: FlowRun  # the same deployment re-run on the same run URL
    commit_mtimes_before_rerun: dict[str, int]


def commit_mtimes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("COMMIT.json")}


def client(server: PrefectServer):
    """A synchronous Prefect client for ``server`` (this process's own settings are left alone)."""
    with temporary_settings({PREFECT_API_URL: server.api_url}):
        return get_client(sync_client=True)


def run_deployment_once(server: PrefectServer, params: dict[str, Any], tmp: Path) -> FlowRun:
    """`prefect deployment run`, then `prefect worker start --run-once` executes it; returns the final run."""
    out = server.cli("deployment", "run", "spotlight-post-train/on-demand", "--params", json.dumps(params), cwd=tmp).stdout
    found = re.search(r"UUID:\s*([0-9a-f-]{36})", out)
    assert found, f"no flow run id in `prefect deployment run` output:\n{out}"
    server.cli("worker", "start", "--pool", "spotlight", "--type", "process", "--run-once", cwd=tmp, timeout=600)
    with client(server) as c:
        return c.read_flow_run(UUID(found.group(1)))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[PrefectServer]:
    """One Prefect server for the module: the local deployments' runs and the cloud deployment's."""
    with prefect_server(tmp_path_factory.mktemp("prefect-server") / "home") as server:
        yield server


@pytest.fixture(scope="module")
def deployed(server: PrefectServer, tmp_path_factory) -> DeployedRun:
    tmp = tmp_path_factory.mktemp("prefect")
    server.cli("work-pool", "create", "spotlight", "--type", "process", cwd=tmp)
    server.cli("deploy", "--name", "nightly", "--name", "on-demand", "--no-prompt", cwd=REPO)
    run_dir = tmp / "store" / "run"
    params = {"config_path": "configs/tiny.yaml", "run_url": f"file://{run_dir}", "overrides": OVERRIDES}
    first = run_deployment_once(server, params, tmp)
    mtimes = commit_mtimes(run_dir.parent)
    second = run_deployment_once(server, params, tmp)
    return DeployedRun(server, run_dir, first, second, mtimes)


def flow_run_artifacts(server: PrefectServer, flow_run_id: UUID) -> dict[str, list[Artifact]]:
    """The flow run's artifacts by key, each key's versions oldest first."""
    with client(server) as c:
        artifacts = c.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    by_key: dict[str, list[Artifact]] = {}
    for a in sorted(artifacts, key=lambda a: a.created):
        by_key.setdefault(a.key, []).append(a)
    return by_key


def update_seconds(server: PrefectServer, flow_run_id: UUID) -> dict[str, float]:
    with client(server) as c:
        task_runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    return {t.name: t.total_run_time.total_seconds() for t in task_runs if t.name.startswith("update-it")}


def test_deployment_runs_from_clone_with_artifacts_and_resumes(deployed: DeployedRun) -> None:
    server, first, second = deployed.server, deployed.first, deployed.second
    assert first.state and first.state.is_completed(), f"first run ended {first.state}"
    assert second.state and second.state.is_completed(), f"re-run ended {second.state}"

    artifacts = flow_run_artifacts(server, first.id)
    assert set(artifacts) == {f"{RUN_NAME}-iterations", f"{RUN_NAME}-report"}
    table = json.loads(artifacts[f"{RUN_NAME}-iterations"][-1].data)
    assert [row["iteration"] for row in table] == [0, 1]
    assert all(0 <= row["train reward"] <= 1 and 0 <= row["held-out reward after"] <= 1 for row in table)
    assert all(re.fullmatch(r"n/a|\$\d+\.\d{4}", row["cost so far"]) for row in table)
    assert len(artifacts[f"{RUN_NAME}-iterations"]) == 2  # one version per iteration
    report = artifacts[f"{RUN_NAME}-report"][-1].data
    assert "## Reward curve" in report and report.count("](data:image/png;base64,") == 2
    assert f"{deployed.run_dir}/report/samples_before_after.png" in report

    # resume: the re-run found every stage committed and recomputed nothing
    assert commit_mtimes(deployed.run_dir.parent) == deployed.commit_mtimes_before_rerun
    before, after = update_seconds(server, first.id), update_seconds(server, second.id)
    print(f"update task seconds: first run {before}, re-run {after}")
    assert set(before) == set(after) == {"update-it0", "update-it1"}
    assert all(after[name] < before[name] / 3 for name in before), (before, after)

    with client(server) as c:
        nightly = c.read_deployment_by_name("spotlight-post-train/nightly")
    assert [s.schedule.cron for s in nightly.schedules] == ["0 3 * * *"] and nightly.schedules[0].active
    assert nightly.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}]
    assert nightly.work_pool_name == "spotlight"


def render(url: str, name: str, user_data: Path) -> str:
    """Load ``url`` in headless Chromium, let the SPA render, save a screenshot; return the rendered DOM."""
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={user_data}", "--virtual-time-budget=15000", "--window-size=1400,1000"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.stdout.strip(), f"chromium rendered nothing for {url}:\n{dom.stderr[-2000:]}"
    (UI_OUT / f"{name}.html").write_text(dom.stdout)
    shot = UI_OUT / f"{name}.png"
    subprocess.run([*flags, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000, f"no screenshot of {url}"
    print(f"UI check: {url} -> {shot}")
    return dom.stdout


def visible_text(html: str) -> str:
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", html.split("<body", 1)[-1], flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))


@pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                    reason="needs Debian chromium: apt-get update && apt-get install -y chromium")
def test_ui_shows_run_state_and_artifacts(deployed: DeployedRun, tmp_path) -> None:
    server, run = deployed.server, deployed.first
    shutil.rmtree(UI_OUT, ignore_errors=True)
    UI_OUT.mkdir(parents=True)
    page = visible_text(render(f"{server.url}/runs/flow-run/{run.id}", "flow-run", tmp_path / "chromium-1"))
    assert run.name in page and "Completed" in page and "iteration 1: train reward" in page, page[:2000]

    artifacts = flow_run_artifacts(server, run.id)
    report_url = f"{server.url}/artifacts/artifact/{artifacts[f'{RUN_NAME}-report'][-1].id}"
    for attempt in range(3):  # on a loaded machine the page may be dumped before its images are in the DOM
        report = render(report_url, "report", tmp_path / f"chromium-2-{attempt}")
        images = len(re.findall(r'<img[^>]*src="data:image/png;base64,', report))
        if images == 2:
            break
    assert "Reward curve" in visible_text(report) and run.name in visible_text(report)
    assert images == 2, f"{images} images in the report's page (the curve and the samples expected)"
    table = visible_text(render(f"{server.url}/artifacts/artifact/{artifacts[f'{RUN_NAME}-iterations'][-1].id}",
                                "iterations", tmp_path / "chromium-3"))
    assert "train reward" in table and "zero-variance fraction" in table, table[:2000]


def test_cost_column_is_read_from_the_ledger(tmp_path) -> None:
    store = RunStore(f"file://{tmp_path}")
    assert cost_so_far(store) == "n/a"  # no ledger: no made-up zero
    cost.record(store, "update", 0, seconds=1800, price_per_hour=2.0, where="test")
    assert cost_so_far(store) == "$1.0000"
    assert artifact_key({"run": {"name": "My_Run 7"}}, "iterations") == "my-run-7-iterations"


# -- the cloud deployment: a Prefect worker on an emulated SkyPilot controller -----------------------------
CLOUD_BUCKET = "spotlight-cloud"
PREFECT_KEY = "pnu_CloudDeployTestKey0123456789abcdefXYZ"  # made up: the local server ignores it; nothing may show it
AWS = {"AWS_ACCESS_KEY_ID": "AKIACLOUDDEPLOYTEST", "AWS_SECRET_ACCESS_KEY": "cloud+deploy+secret/0123456789abcdef",
       "AWS_DEFAULT_REGION": "us-east-1"}
CLOUD_OVERRIDES = [*SMALL, "grpo.iterations=1", "evaluation.every=1", "run.name=cloud-test"]
CLOUD_TASKS = {"pretrain", "evaluate-it0", "explore-it0", "filter-it0", "update-it0", "record-it0", "evaluate-it1",
               "report"}


@dataclass
class CloudRuns:
    server: PrefectServer
    api: JobsApi
    repository: str
    commit: str
    clone: dict[str, Any]  # the completed run's clone, seen while it ran: its path and HEAD
    controller_log: Path
    storage: dict[str, Any]  # the moto run store's s3fs options
    runs: dict[str, FlowRun]  # completed, crashed, timed-out
    urls: dict[str, str]


def source_repository(tmp: Path) -> tuple[Path, str]:
    """This working tree (tracked and untracked, not ignored) as a git repository at one commit."""
    src = tmp / "spotlight.git"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    git = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "init.defaultBranch=main"]
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "the tree under test"]):
        subprocess.run([*git, *args], cwd=src, check=True, capture_output=True)
    return src, subprocess.run(["git", "rev-parse", "HEAD"], cwd=src, capture_output=True, text=True,
                               check=True).stdout.strip()


def start_controller(workdir: Path, tmp: Path, secrets: dict[str, str], api: JobsApi) -> tuple[subprocess.Popen, Path]:
    """sky/controller.yaml as `sky jobs launch ... --env PREFECT_WORK_POOL=spotlight-cloud --secret ...` gives it
    (parsed by SkyPilot), its `run:` script in a local process with a managed job's environment. Setup (pip
    install -e .) is skipped: the workdir on PYTHONPATH stands in for it."""
    raw = yaml.safe_load((workdir / "sky" / "controller.yaml").read_text())
    task = sky.Task.from_yaml_config(raw, env_overrides=[("PREFECT_WORK_POOL", "spotlight-cloud")],
                                     secrets_overrides=list(secrets.items()))
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp / "controller-home"),
           "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(workdir),
           "PREFECT_HOME": str(tmp / "controller-home" / ".prefect"), "SKYPILOT_DISABLE_USAGE_COLLECTION": "1",
           **{k: str(v) for k, v in task.envs.items()},
           **{k: v.get_secret_value() for k, v in task.secrets.items()},
           "SKYPILOT_TASK_ID": "sky-managed-2026-01-01-03-00-00-000000_spotlight-prefect_1-0",
           # the seam, and quicker polls than a real cloud needs (a test's minutes)
           "SPOTLIGHT_SKY_JOBS": "tests.jobs_api:RemoteSkyJobs", "SPOTLIGHT_JOBS_API": api.url,
           "SPOTLIGHT_POOL_POLL_SECONDS": "0.5", "SPOTLIGHT_POLL_SECONDS": "0.1", "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = tmp / "controller.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(["bash", "-c", task.run], cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc, log


def wait_for(what: str, check, timeout: float, *logs: Path):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p}:\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.is_file())
            raise AssertionError(f"timed out waiting for {what}\n{tails}")
        time.sleep(0.5)
    return value


def final_run(server: PrefectServer, flow_run_id: UUID) -> FlowRun | None:
    with client(server) as c:
        run = c.read_flow_run(flow_run_id)
    return run if run.state is not None and run.state.is_final() else None


def run_jobs(api: JobsApi, url: str) -> list[dict[str, Any]]:
    return [r for r in api.jobs.queue(run_prefix(url)) if r["job_name"].startswith(run_prefix(url))]


def flow_run_process(flow_run_id: UUID) -> int | None:
    """The pid of the process executing a flow run (the Prefect worker's subprocess), from /proc."""
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in (proc / "environ").read_bytes():
                return int(proc.name)
        except OSError:
            continue
    return None


@pytest.fixture(scope="module")
def cloud(server: PrefectServer, tmp_path_factory, cache_url) -> Iterator[CloudRuns]:
    tmp = tmp_path_factory.mktemp("prefect-cloud")
    src, commit = source_repository(tmp)
    laptop = tmp / "laptop"  # where the user deploys from: a clone whose origin is the repository
    subprocess.run(["git", "clone", "-q", f"file://{src}", str(laptop)], check=True, capture_output=True)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    (tmp / "controller-home").mkdir()
    moto = Moto()
    moto.start()
    try:
        boto3.client("s3", endpoint_url=moto.endpoint, **{k.lower(): v for k, v in AWS.items() if k != "AWS_DEFAULT_REGION"},
                     region_name="us-east-1").create_bucket(Bucket=CLOUD_BUCKET)
        urls = {name: f"s3://{CLOUD_BUCKET}/runs/{name}" for name in ("nightly", "crash", "timeout")}
        server.cli("work-pool", "create", "spotlight-cloud", "--type", "process", cwd=tmp)
        server.cli("deploy", "--name", "cloud-nightly", "--no-prompt", cwd=laptop,
                   env={"SPOTLIGHT_CLOUD_RUN_URL": urls["nightly"]})
        spec = tmp / "cluster.json"  # one trainer slot, capacity from the start and no preemption
        spec.write_text(json.dumps({"traces": str(REPO / "sky/traces/aws-v100-1node-2023-04-22"), "compress": 1800.0,
                                    "recovery_seconds": 1.0, "grace_seconds": 3.0, "preempt_window_seconds": 0.0,
                                    "logdir": str(tmp / "cluster"),
                                    "jobs": {"trainer-0": {"zone": "us-east-1f", "start_tick": 4964}}}))
        secrets = {**{k: v for k, v in AWS.items() if k != "AWS_DEFAULT_REGION"}, "AWS_ENDPOINT_URL": moto.endpoint,
                   "PREFECT_API_URL": server.api_url, "PREFECT_API_KEY": PREFECT_KEY}
        with jobs_api(str(spec)) as api:
            controller, log = start_controller(laptop, tmp, secrets, api)
            logs = (log, server.log)
            try:
                with client(server) as c:
                    deployment = c.read_deployment_by_name("spotlight-post-train/cloud-nightly")

                    def trigger(*extra: str, run_url: str | None = None) -> UUID:
                        params = {"overrides": [*CLOUD_OVERRIDES, f"run.cache_url={cache_url}", *extra]}
                        return c.create_flow_run_from_deployment(
                            deployment.id, parameters=params if run_url is None else {**params, "run_url": run_url}).id

                    # all three at once (the worker runs them side by side): one to completion, with the
                    # deployment's run_url; one whose process is killed; one past its timeout (~14 s)
                    ids = {"completed": trigger(), "crashed": trigger(run_url=urls["crash"]),
                           "timed-out": trigger("placement.flow_timeout_hours=0.004", run_url=urls["timeout"])}
                [trainer] = wait_for("the cloud run's trainer", lambda: [r for r in run_jobs(api, urls["nightly"])
                                                                           if status(r) == "RUNNING"], 300, *logs)
                [job] = [j for j in api.jobs.jobs if j.job_id == trainer["job_id"]]
                workdir = Path(job.task.workdir)  # the flow run's clone (Prefect removes it after the run)
                clone = {"workdir": workdir, "head": subprocess.run(["git", "rev-parse", "HEAD"], cwd=workdir,
                                                                    capture_output=True, text=True).stdout.strip()}
                wait_for("the crash run's trainer", lambda: any(status(r) == "RUNNING" for r in run_jobs(api, urls["crash"])),
                         300, *logs)
                pid = wait_for("the crash run's process", lambda: flow_run_process(ids["crashed"]), 60, *logs)
                os.kill(pid, signal.SIGKILL)  # the flow's process dies outright: no finally, no hook in it
                runs = {name: wait_for(f"the {name} run", lambda i=i: final_run(server, i), 600, *logs)
                        for name, i in ids.items()}
                # the hook's last word (after it cancelled the jobs and marked the pool done)
                hook_said = f"the workers of {urls['crash']} were told to leave"
                wait_for("the crash hook", lambda: hook_said in log.read_text(errors="replace"), 180, *logs)
            finally:
                stop_process_group(controller, 30)
            yield CloudRuns(server, api, f"file://{src}", commit, clone, log,
                            {"endpoint_url": moto.endpoint, "key": AWS["AWS_ACCESS_KEY_ID"],
                             "secret": AWS["AWS_SECRET_ACCESS_KEY"]}, runs, urls)
    finally:
        moto.stop()


def test_cloud_deployment_runs_on_the_controller_from_a_git_clone_at_its_commit(cloud: CloudRuns) -> None:
    """`prefect deploy` from a clone records its origin and commit; the Prefect worker on the emulated
    controller pulls the flow with git_clone, runs it to Completed with every stage task and both artifacts,
    and its trainer is a managed job whose workdir is that clone."""
    server, run = cloud.server, cloud.runs["completed"]
    assert run.state.is_completed(), f"the cloud run ended {run.state}: {run.state.message}\n" + \
        cloud.controller_log.read_text()[-5000:]
    with client(server) as c:
        deployment = c.read_deployment_by_name("spotlight-post-train/cloud-nightly")
        task_runs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    assert deployment.pull_steps == [{"prefect.deployments.steps.git_clone": {
        "id": "clone", "repository": cloud.repository, "commit_sha": cloud.commit}}]
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"] and deployment.schedules[0].active
    assert deployment.work_pool_name == "spotlight-cloud" and run.parameters["run_url"] == cloud.urls["nightly"]
    names = {t.name if "-it" in t.name else t.name.rsplit("-", 1)[0] for t in task_runs}  # pretrain-0a1 -> pretrain
    assert CLOUD_TASKS <= names and all(t.state.is_completed() for t in task_runs), \
        sorted((t.name, t.state.name) for t in task_runs)
    artifacts = flow_run_artifacts(server, run.id)
    assert set(artifacts) == {"cloud-test-iterations", "cloud-test-report"}
    [job] = run_jobs(cloud.api, cloud.urls["nightly"])  # one trainer, launched once, left when the run was over
    assert status(job) == "SUCCEEDED" and job["resources"]["instance_type"]
    # the job's workdir was the flow run's clone (named after the repository), at the deployed commit
    assert cloud.clone["workdir"].name == "spotlight" and cloud.clone["head"] == cloud.commit
    store = RunStore(cloud.urls["nightly"], cloud.storage)
    assert store.is_committed("iterations/0000/update") and store.is_committed("evaluations/0001")


def test_a_crashed_cloud_flow_run_has_its_workers_cancelled_by_the_on_crashed_hook(cloud: CloudRuns) -> None:
    """kill -9 of the flow's process leaves its trainer job running (a managed job outlives the process
    that launched it); the Prefect worker reports the crash and runs the flow's on_crashed hook, which
    cancels the job through SkyPilot's API and tells the run's workers to leave."""
    run = cloud.runs["crashed"]
    assert run.state.is_crashed(), f"{run.state}: {run.state.message}"
    jobs = run_jobs(cloud.api, cloud.urls["crash"])
    assert jobs and all(status(r) == "CANCELLED" for r in jobs), jobs
    assert pool_done(RunStore(cloud.urls["crash"], cloud.storage))
    worker_log = cloud.controller_log.read_text(errors="replace")  # the Prefect worker's output: the hook ran there
    assert f"ended Crashed: the workers of {cloud.urls['crash']} were told to leave; cancelled managed jobs " \
        f"{[jobs[0]['job_name']]}" in worker_log, worker_log[-3000:]


def test_a_cloud_flow_run_past_its_timeout_ends_timed_out_with_its_workers_cancelled(cloud: CloudRuns) -> None:
    run = cloud.runs["timed-out"]
    assert run.state.is_failed() and run.state.name == "TimedOut", f"{run.state}: {run.state.message}"
    assert "placement.flow_timeout_hours (0.004 h)" in run.state.message
    jobs = run_jobs(cloud.api, cloud.urls["timeout"])
    assert jobs and all(status(r) == "CANCELLED" for r in jobs), jobs


def test_prefect_and_aws_keys_appear_in_no_log_and_no_object(cloud: CloudRuns) -> None:
    """PREFECT_API_KEY and the AWS keys are SkyPilot secrets of the controller: not in its log, the jobs'
    logs, the flow runs' logs on the server, or any object of the run stores."""
    planted = [PREFECT_KEY, AWS["AWS_SECRET_ACCESS_KEY"]]
    texts = {str(cloud.controller_log): cloud.controller_log.read_text(errors="replace")}
    for path in (cloud.controller_log.parent / "cluster").glob("*.log"):
        texts[str(path)] = path.read_text(errors="replace")
    with client(cloud.server) as c:
        for name, run in cloud.runs.items():
            logs = c.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            texts[f"flow run {name}"] = "\n".join(log.message for log in logs)
    s3 = boto3.client("s3", endpoint_url=cloud.storage["endpoint_url"], aws_access_key_id=cloud.storage["key"],
                      aws_secret_access_key=cloud.storage["secret"], region_name="us-east-1")
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=CLOUD_BUCKET)
            for o in page.get("Contents", [])]
    assert len(keys) > 50
    for key in keys:
        texts[key] = s3.get_object(Bucket=CLOUD_BUCKET, Key=key)["Body"].read().decode("latin-1")
    leaks = [(where, secret[:8]) for where, text in texts.items() for secret in planted if secret in text]
    assert not leaks, leaks
    assert "Prefect worker for work pool spotlight-cloud" in texts[str(cloud.controller_log)]
