"""The launcher at the SkyPilot boundary: only ``SkyJobs`` (the calls into sky.jobs) is replaced.

Everything else is real: the stage YAML is parsed by ``sky.Task.from_yaml``, envs, secrets and the
config mount are filled in on a real ``sky.Task``, names are derived, the queue is deduplicated and
polled, failures are formatted, and interrupts cancel the job.
"""

from __future__ import annotations

import os

import pytest
import yaml

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

from spotlight.config import load_config  # noqa: E402
from tasks.launcher import (REMOTE_CONFIG, InProcess, SkyJobFailed, SkyJobs, SkyLauncher,  # noqa: E402
                            job_name, launcher_from_env)

SECRET = "fakeSECRETkey/for+launcher+tests0123456789"
ENV = {"AWS_ACCESS_KEY_ID": "AKIALAUNCHERTEST", "AWS_SECRET_ACCESS_KEY": SECRET}
RUN = "s3://bucket/runs/exp1"


def _config(url: str = RUN) -> dict:
    return load_config("configs/tiny.yaml", [f"run.url={url}", "grpo.iterations=3"]).model_dump(mode="json")


class FakeSkyJobs(SkyJobs):
    """Stands in for SkyPilot's jobs controller: each queue() call moves launched jobs one status on."""

    def __init__(self, script: list[str], existing: list[dict] | None = None, logs: str = "",
                 interrupt_on_poll: int | None = None):
        self.script, self.records, self.log_text = script, list(existing or []), logs
        self.launched: list[tuple[object, str, str]] = []  # (task, name, config text at launch)
        self.cancelled: list[str] = []
        self.polls, self.interrupt_on_poll = 0, interrupt_on_poll
        self._steps: dict[int, int] = {}

    def launch(self, task, name):
        with open(task.file_mounts[REMOTE_CONFIG]) as f:
            self.launched.append((task, name, f.read()))
        job_id = max([r["job_id"] for r in self.records], default=0) + 1
        self.records.append({"job_id": job_id, "job_name": name, "status": "PENDING", "recovery_count": 0,
                             "failure_reason": None})
        self._steps[job_id] = 0
        return job_id

    def queue(self, name_match):
        self.polls += 1
        if self.interrupt_on_poll is not None and self.polls >= self.interrupt_on_poll:
            raise KeyboardInterrupt
        for r in self.records:
            if r["job_id"] in self._steps and self._steps[r["job_id"]] < len(self.script):
                r["status"] = self.script[self._steps[r["job_id"]]]
                r["recovery_count"] += r["status"] == "RECOVERING"
                self._steps[r["job_id"]] += 1
        return [dict(r) for r in self.records if name_match in r["job_name"]]

    def cancel(self, name):
        self.cancelled.append(name)
        for r in self.records:
            if r["job_name"] == name and r["status"] not in ("SUCCEEDED", "FAILED", "CANCELLED"):
                r["status"] = "CANCELLED"

    def logs(self, job_id, tail):
        return "\n".join(self.log_text.splitlines()[-tail:])


def _launcher(jobs: FakeSkyJobs, **kw) -> SkyLauncher:
    return SkyLauncher(jobs=jobs, poll_seconds=0, log_tail_lines=3, environ=ENV, **kw)


def test_launch_builds_the_real_task_and_waits_through_a_preemption():
    jobs = FakeSkyJobs(["PENDING", "STARTING", "RUNNING", "RECOVERING", "RUNNING", "SUCCEEDED"])
    record = _launcher(jobs, num_nodes=2).run_stage("update", 1, _config())
    assert record["status"] == "SUCCEEDED" and record["recovery_count"] == 1
    [(task, name, config_text)] = jobs.launched
    assert name == job_name(RUN, "update", 1) == "spotlight-exp1-" + name.split("-")[2] + "-update-0001"
    assert name == job_name(RUN + "/", "update", 1)  # deterministic: same run, same name
    assert job_name("s3://other/runs/exp1", "update", 1) != name  # another bucket's run never collides
    # envs, secrets, config mount and nodes, on the task SkyPilot parsed from sky/update.yaml
    assert task.envs["RUN_URL"] == RUN and task.envs["ITERATION"] == "1" and task.envs["CONFIG"] == REMOTE_CONFIG
    secrets = {k: v.get_secret_value() for k, v in task.secrets.items()}  # SkyPilot keeps them as SecretStr
    assert secrets["AWS_SECRET_ACCESS_KEY"] == SECRET and secrets["AWS_ACCESS_KEY_ID"] == ENV["AWS_ACCESS_KEY_ID"]
    assert not task.managed_secret_refs  # all filled in, as `sky jobs launch --secret` would
    assert SECRET not in repr(task.secrets) and SECRET not in str(task.envs)
    assert task.num_nodes == 2 and all(r.use_spot for r in task.resources) and len(task.resources) >= 3
    assert yaml.safe_load(config_text) == _config()  # the job runs on exactly the run's config
    assert not os.path.exists(task.file_mounts[REMOTE_CONFIG])  # the temp copy is cleaned up
    assert jobs.cancelled == []


def test_a_retry_never_launches_a_duplicate():
    name = job_name(RUN, "update", 2)
    decoy = {"job_id": 7, "job_name": name + "0", "status": "RUNNING", "recovery_count": 0, "failure_reason": None}
    # a previous attempt's job is still running: wait on it (its status advances as the fake polls)
    running = FakeSkyJobs([], existing=[decoy, {"job_id": 8, "job_name": name, "status": "RUNNING",
                                                 "recovery_count": 0, "failure_reason": None}])
    running._steps[8] = 0
    running.script = ["RUNNING", "SUCCEEDED"]
    assert _launcher(running).run_stage("update", 2, _config())["job_id"] == 8
    assert running.launched == []
    # it already succeeded: return at once
    done = FakeSkyJobs([], existing=[{"job_id": 3, "job_name": name, "status": "SUCCEEDED",
                                      "recovery_count": 0, "failure_reason": None}])
    assert _launcher(done).run_stage("update", 2, _config())["job_id"] == 3 and done.launched == []
    # it failed before: this retry launches a fresh job (the stage resumes from the last commit)
    failed = FakeSkyJobs(["RUNNING", "SUCCEEDED"], existing=[{"job_id": 4, "job_name": name, "status": "FAILED",
                                                               "recovery_count": 0, "failure_reason": "oom"}])
    assert _launcher(failed).run_stage("update", 2, _config())["job_id"] == 5
    assert [n for _, n, _ in failed.launched] == [name]


def test_a_failed_job_raises_with_status_and_log_tail_without_the_secret():
    log = "\n".join([f"line {i}" for i in range(10)] + [f"botocore says key {SECRET} was rejected", "Traceback: boom"])
    jobs = FakeSkyJobs(["STARTING", "FAILED_SETUP"], logs=log)
    with pytest.raises(SkyJobFailed) as err:
        _launcher(jobs).run_stage("explore", 0, _config())
    message = str(err.value)
    assert err.value.status == "FAILED_SETUP" and "ended FAILED_SETUP" in message
    assert "Traceback: boom" in message and "line 9" in message and "line 3" not in message  # last 3 lines
    assert SECRET not in message and "***" in message
    assert jobs.cancelled == []  # a failure is final; nothing to cancel


def test_interrupt_cancels_the_job_and_cancel_run_cancels_only_active_jobs_of_the_run():
    jobs = FakeSkyJobs(["PENDING", "RUNNING", "RUNNING", "RUNNING"], interrupt_on_poll=3)
    with pytest.raises(KeyboardInterrupt):
        _launcher(jobs).run_stage("update", 0, _config())
    assert jobs.cancelled == [job_name(RUN, "update", 0)]

    other = job_name("s3://bucket/runs/exp2", "update", 0)
    jobs = FakeSkyJobs([], existing=[
        {"job_id": 1, "job_name": job_name(RUN, "update", 0), "status": "SUCCEEDED"},
        {"job_id": 2, "job_name": job_name(RUN, "update", 1), "status": "RECOVERING"},
        {"job_id": 3, "job_name": job_name(RUN, "explore", 2), "status": "RUNNING"},
        {"job_id": 4, "job_name": other, "status": "RUNNING"}])
    assert _launcher(jobs).cancel_run(RUN) == sorted([job_name(RUN, "update", 1), job_name(RUN, "explore", 2)])
    assert other not in jobs.cancelled


def test_clear_errors_before_anything_is_launched():
    jobs = FakeSkyJobs(["SUCCEEDED"])
    with pytest.raises(ValueError, match="needs a bucket run store"):
        _launcher(jobs).run_stage("update", 0, _config("file:///tmp/runs/x"))
    with pytest.raises(ValueError, match="no SkyPilot task for stage 'filter'"):
        _launcher(jobs).run_stage("filter", 0, _config())
    assert jobs.launched == [] and jobs.cancelled == []


def test_launcher_from_env():
    assert isinstance(launcher_from_env({}), InProcess)
    assert InProcess().run_stage("update", 0, _config(), lambda: 42) == 42
    assert isinstance(launcher_from_env({"SPOTLIGHT_LAUNCHER": "sky"}), SkyLauncher)
    with pytest.raises(ValueError, match="expected 'local' or 'sky'"):
        launcher_from_env({"SPOTLIGHT_LAUNCHER": "k8s"})
