"""Run a stage in-process (the embedded default) or as a SkyPilot managed job on spot GPUs.

Choose with ``SPOTLIGHT_LAUNCHER=local|sky`` (``launcher_from_env``). In sky mode a stage is the
task in ``sky/<stage yaml>``, launched with ``sky.jobs.launch`` under a deterministic name (run +
stage + iteration) and waited on through SkyPilot's jobs API:

* A Prefect retry never starts a duplicate: the launcher looks the name up first; a running job
  is waited on, a succeeded one returned at once; only a failed/cancelled (or absent) one is
  launched again (stages are idempotent, so a relaunch resumes from the last commit).
* A failed job raises ``SkyJobFailed`` with its status, failure reason and the tail of its log.
* Interrupting the wait (Ctrl-C, Prefect cancellation/termination, any BaseException) cancels the
  job by name before re-raising. Flows can also attach ``on_flow_cancellation`` as Prefect's
  ``on_cancellation`` hook, which cancels every active job of the run (for cancellations that
  kill the flow process before it can react).

Every call into SkyPilot's jobs API goes through ``SkyJobs``: the one seam tests replace.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import yaml

from spotlight.config import config_from_dict, load_config
from tasks.placement import SKY_DIR, STAGE_YAMLS

T = TypeVar("T")
SUCCEEDED, CANCELLED, CANCELLING = "SUCCEEDED", "CANCELLED", "CANCELLING"
FAILED = frozenset({"FAILED", "FAILED_SETUP", "FAILED_PRECHECKS", "FAILED_NO_RESOURCE", "FAILED_CONTROLLER"})
ACTIVE = frozenset({"PENDING", "SUBMITTED", "STARTING", "RUNNING", "RECOVERING", "WINDING_DOWN"})
REMOTE_CONFIG = "/tmp/spotlight/config.yaml"  # where the run's config is mounted in the job
REQUIRED_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow/task run (so it shows in the UI), else the module logger."""
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:  # noqa: BLE001 - MissingContextError outside a run
        return logging.getLogger(__name__)


class SkyJobFailed(RuntimeError):
    """A managed job ended FAILED*/CANCELLED; the message has its status and log tail."""

    def __init__(self, name: str, record: Mapping[str, Any], log_tail: str):
        self.name, self.record, self.status = name, dict(record), record.get("status")
        reason = record.get("failure_reason") or "no reason given"
        super().__init__(
            f"managed job {name} (id {record.get('job_id')}) ended {self.status} after "
            f"{record.get('recovery_count') or 0} recoveries: {reason}\n"
            f"--- last lines of its log ---\n{log_tail.rstrip() or '(no log)'}")


class SkyJobs:
    """The seam: SkyPilot's managed-jobs API, and nothing else. Records come back as plain dicts."""

    def launch(self, task: Any, name: str) -> int:
        import sky

        job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=name))
        if not job_ids:
            raise RuntimeError(f"sky.jobs.launch returned no job id for {name}")
        return int(job_ids[0])

    def queue(self, name_match: str) -> list[dict[str, Any]]:
        """Jobs whose name contains ``name_match`` (SkyPilot matches substrings; callers filter)."""
        import sky

        records = sky.get(sky.jobs.queue_v2(refresh=False, name_match=name_match))[0]
        out = []
        for r in records:
            r = r if isinstance(r, dict) else r.model_dump()
            status = r.get("status")
            out.append({"job_id": r.get("job_id"), "job_name": r.get("job_name"),
                        "status": getattr(status, "value", status), "recovery_count": r.get("recovery_count"),
                        "failure_reason": r.get("failure_reason")})
        return out

    def cancel(self, name: str) -> None:
        import sky

        sky.get(sky.jobs.cancel(name=name))

    def logs(self, job_id: int, tail: int) -> str:
        import io

        import sky

        buf = io.StringIO()
        sky.jobs.tail_logs(job_id=job_id, follow=False, tail=tail, output_stream=buf)
        return buf.getvalue()


def job_name(run_url: str, stage: str, iteration: int) -> str:
    """Deterministic managed-job name: the same stage of the same run always has the same name."""
    return f"{run_prefix(run_url)}{stage}-{iteration:04d}"


def run_prefix(run_url: str) -> str:
    """``spotlight-<run>-<hash of the URL>-``: a readable, unique, lowercase name prefix for a run."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_url.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:20] or "run"
    return f"spotlight-{slug}-{hashlib.sha256(run_url.rstrip('/').encode()).hexdigest()[:6]}-"


class InProcess:
    """The embedded default: the stage function runs here and its result is returned."""

    def run_stage(self, stage: str, iteration: int, config: dict[str, Any], local: Callable[[], T]) -> T:
        return local()


class SkyLauncher:
    """Stages as SkyPilot managed jobs; returns the job record once it SUCCEEDED (read results from the store)."""

    def __init__(self, jobs: SkyJobs | None = None, sky_dir: Path = SKY_DIR, poll_seconds: float = 15.0,
                 log_tail_lines: int = 40, num_nodes: int | None = None,
                 environ: Mapping[str, str] | None = None):
        self.jobs = jobs or SkyJobs()
        self.sky_dir, self.poll_seconds, self.log_tail_lines = Path(sky_dir), poll_seconds, log_tail_lines
        self.num_nodes = num_nodes
        self.environ = os.environ if environ is None else environ

    # -- what to launch ------------------------------------------------------------------------
    def secrets(self) -> dict[str, str]:
        """AWS credentials from the standard chain (env, ~/.aws, instance role); the endpoint if set."""
        values = {k: self.environ[k] for k in (*REQUIRED_SECRETS, "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")
                  if self.environ.get(k)}
        if not all(k in values for k in REQUIRED_SECRETS):
            import botocore.session

            creds = botocore.session.get_session().get_credentials()
            if creds is None:
                raise RuntimeError("launching a stage on SkyPilot needs AWS credentials for the run store "
                                   f"({' and '.join(REQUIRED_SECRETS)} in the environment, or ~/.aws); none found")
            frozen = creds.get_frozen_credentials()
            values.update(AWS_ACCESS_KEY_ID=frozen.access_key, AWS_SECRET_ACCESS_KEY=frozen.secret_key)
            if frozen.token:
                values["AWS_SESSION_TOKEN"] = frozen.token
        return values

    def build_task(self, stage: str, iteration: int, config: dict[str, Any], config_file: Path) -> Any:
        """The stage's task YAML with the run's envs, config file mount and secrets filled in."""
        import sky

        cfg = config_from_dict(config)
        if not cfg.run_url.startswith(("s3://", "gs://", "r2://")):
            raise ValueError(f"stage {stage} on SkyPilot needs a bucket run store (s3://...), but the run is "
                             f"{cfg.run_url}: a cloud VM cannot see this machine's disk")
        config_file.write_text(yaml.safe_dump(config, sort_keys=True))
        raw = yaml.safe_load((self.sky_dir / STAGE_YAMLS[stage]).read_text())
        envs = {"RUN_URL": cfg.run_url, "ITERATION": str(iteration), "CONFIG": REMOTE_CONFIG}
        # As `sky jobs launch --env K=V --secret K` does: overrides go in before SkyPilot turns
        # null-valued secrets into managed-secret references.
        task = sky.Task.from_yaml_config(
            raw, env_overrides=[(k, v) for k, v in envs.items() if k in (raw.get("envs") or {})],
            secrets_overrides=list(self.secrets().items()))
        missing = [k for k, v in task.envs.items() if v == "" and k in ("RUN_URL", "ITERATION")]
        if missing:
            raise ValueError(f"{STAGE_YAMLS[stage]}: required envs {missing} are not set by the launcher")
        task.update_file_mounts({REMOTE_CONFIG: str(config_file)})
        if task.workdir == ".":
            task.workdir = str(self.sky_dir.parent)
        if self.num_nodes is not None and stage == "update":
            task.num_nodes = self.num_nodes
        return task

    # -- launching and waiting -----------------------------------------------------------------
    def latest(self, name: str) -> dict[str, Any] | None:
        """The newest job with exactly this name (SkyPilot's name filter matches substrings)."""
        mine = [r for r in self.jobs.queue(name) if r["job_name"] == name]
        return max(mine, key=lambda r: r["job_id"]) if mine else None

    def run_stage(self, stage: str, iteration: int, config: dict[str, Any],
                  local: Callable[[], T] | None = None) -> dict[str, Any]:
        """Launch (or find) the stage's job and wait for it; ``local`` is ignored (InProcess's signature)."""
        name, job_id = self.start(stage, iteration, config)
        if job_id is None:
            return self.latest(name)
        try:
            return self.wait(name, job_id)
        except SkyJobFailed:
            raise
        except BaseException:  # Ctrl-C, Prefect cancellation/termination, API errors: do not leave it running
            self._cancel_after_interrupt(name)
            raise

    def start(self, stage: str, iteration: int, config: dict[str, Any]) -> tuple[str, int | None]:
        """Launch the stage's job unless one of that name is active (returns its id) or succeeded (None).

        ``iteration`` names the job: the iteration for a stage, the worker index for exploration workers.
        """
        if stage not in STAGE_YAMLS:
            raise ValueError(f"no SkyPilot task for stage {stage!r}; stages with one: {', '.join(STAGE_YAMLS)}")
        log = _logger()
        name = job_name(config_from_dict(config).run_url, stage, iteration)
        existing = self.latest(name)
        if existing is not None and existing["status"] == SUCCEEDED:
            log.info("managed job %s (id %s) already succeeded; not launching again", name, existing["job_id"])
            return name, None
        if existing is not None and existing["status"] in ACTIVE:
            log.info("managed job %s (id %s) is %s; waiting on it instead of launching a duplicate",
                     name, existing["job_id"], existing["status"])
            return name, existing["job_id"]
        tmp = Path(tempfile.mkdtemp(prefix="spotlight-launch-"))
        try:
            task = self.build_task(stage, iteration, config, tmp / "config.yaml")  # errors here launch nothing
            try:
                job_id = self.jobs.launch(task, name)
            except BaseException:
                self._cancel_after_interrupt(name)  # it may have been submitted before the interrupt
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("launched managed job %s (id %s): stage %s iteration %d, envs %s, secrets %s "
                 "(values not shown); SKYPILOT_TASK_ID keys its resume across spot recoveries",
                 name, job_id, stage, iteration, task.envs, sorted(task.secrets))
        return name, job_id

    def _cancel_after_interrupt(self, name: str) -> None:
        _logger().warning("interrupted while running %s; cancelling the managed job", name)
        self.jobs.cancel(name)

    def wait(self, name: str, job_id: int) -> dict[str, Any]:
        """Poll until the job is terminal: the record on SUCCEEDED, else SkyJobFailed with its log tail."""
        log, last = _logger(), None
        while True:
            record = next((r for r in self.jobs.queue(name) if r["job_id"] == job_id), None)
            if record is None:
                raise SkyJobFailed(name, {"job_id": job_id, "status": "MISSING",
                                          "failure_reason": "the job vanished from SkyPilot's queue"}, "")
            if record["status"] != last:
                last = record["status"]
                log.info("managed job %s (id %s): %s (recoveries: %s)", name, job_id, last,
                         record.get("recovery_count") or 0)
            if record["status"] == SUCCEEDED:
                return record
            if record["status"] in FAILED or record["status"] == CANCELLED:
                raise SkyJobFailed(name, record, self._redact(self.jobs.logs(job_id, self.log_tail_lines)))
            time.sleep(self.poll_seconds)

    def cancel_run(self, run_url: str) -> list[str]:
        """Cancel every active managed job of a run (names with the run's prefix); returns their names."""
        prefix = run_prefix(run_url)
        names = sorted({r["job_name"] for r in self.jobs.queue(prefix)
                        if r["job_name"].startswith(prefix) and r["status"] in ACTIVE})
        for name in names:
            self.jobs.cancel(name)
        return names

    def _redact(self, text: str) -> str:
        """Job logs are the user's output; still, never echo a credential we passed in."""
        for key in (*REQUIRED_SECRETS, "AWS_SESSION_TOKEN"):
            value = self.environ.get(key)
            if value and len(value) >= 8:
                text = text.replace(value, "***")
        return text


def launcher_from_env(environ: Mapping[str, str] | None = None) -> InProcess | SkyLauncher:
    """``SPOTLIGHT_LAUNCHER=sky`` -> SkyLauncher; unset or ``local`` -> InProcess."""
    kind = (environ if environ is not None else os.environ).get("SPOTLIGHT_LAUNCHER", "local")
    if kind == "local":
        return InProcess()
    if kind == "sky":
        return SkyLauncher()
    raise ValueError(f"SPOTLIGHT_LAUNCHER={kind!r}: expected 'local' or 'sky'")


def on_flow_cancellation(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect ``on_cancellation`` hook for the post-training flow: cancel the run's managed jobs."""
    if not isinstance(launcher_from_env(), SkyLauncher):
        return
    params = flow_run.parameters
    cfg = load_config(params.get("config_path", "configs/tiny.yaml"), params.get("overrides"), params.get("run_url"))
    names = SkyLauncher().cancel_run(cfg.run_url)
    logging.getLogger(__name__).warning("flow cancelled: cancelled managed jobs %s", names)
