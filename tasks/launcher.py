"""The worker pool's launcher: each long-lived worker as a SkyPilot managed job (``SPOTLIGHT_LAUNCHER=sky``).

A worker of a kind (``trainer``, ``explorer``) is the task in ``sky/<kind>.yaml`` with its resources
taken from the run's ``placement`` (accelerators as ``any_of``, spot or on-demand, CPUs, memory, disk),
launched with ``sky.jobs.launch`` under a deterministic name (run + kind + index) so a restarted
controller finds its workers instead of starting more:

* ``start`` launches a worker unless a job of that name is active (then it is the worker);
* the pool (``tasks/workers.py``) relaunches a worker whose job ended while the run still needs it,
  and gives up (naming the job, its status, failure reason and log tail) after
  ``placement.max_relaunches``; SkyPilot's own ``job_recovery`` handles preemptions in between, so a
  preemption is a recovery of the same job, not a launch. Errors are the pool's alone: its jobs run with
  ``max_restarts_on_errors: 0`` (the YAML's value is for jobs launched by hand), so one failing worker
  boots at most ``1 + placement.max_relaunches`` times instead of that times ``1 + max_restarts_on_errors``;
* launched from the controller's own managed job, each worker joins its job group as a dynamic member
  (``job_group``): SkyPilot cancels the workers when the controller job ends, fails or is cancelled;
* ``cancel_run`` cancels every active job of the run (also the flow's ``tear_down_pool`` hook).

Every call into SkyPilot's jobs API goes through ``SkyJobs``: the one seam tests replace. It returns
SkyPilot's own records (``sky.jobs.queue_v2``'s ``ManagedJobRecord``, ``sky.status``'s ``StatusResponse``);
everything read from them is read here, the same way for the real API and for a stand-in: the job's
status as SkyPilot's ``ManagedJobStatus``, its resources from the string SkyPilot formats
(``resources_utils.get_readable_resources_repr``: ``1x[spot](gpus=L4:1, cpus=4, mem=16, g6.xlarge,
disk=100)``), which price the cost ledger, and the timestamps that say how long it was provisioning.
``SPOTLIGHT_SKY_JOBS=module:attribute`` names another implementation of the seam (the tests' emulated
cluster runs each job as a local process of its ``setup:`` and ``run:`` commands).
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import importlib
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from spotlight.config import Config, config_from_dict
from tasks.sky_task import REQUIRED_SECRETS, SKY_DIR, WORKER_YAMLS, worker_task_config

if TYPE_CHECKING:  # SkyPilot is imported when a job is launched or read, not when the flow loads
    from sky.jobs.state import ManagedJobStatus

#: SkyPilot's resources string (``resources_utils.format_resource``, prefixed ``{nodes}x`` by
#: ``get_readable_resources_repr``): nodes, spot, then ``gpus=``, ``cpus=``, ``mem=``, the instance type, ...
RESOURCES = re.compile(r"(?:(?P<nodes>\d+)x)?(?P<spot>\[spot\])?\((?P<inside>.*)\)")
#: what a job record carries through to the pool and the ledger
TIMESTAMPS = ("submitted_at", "start_at", "end_at", "last_recovered_at", "job_duration")


@functools.cache
def job_status() -> type[ManagedJobStatus]:
    """SkyPilot's ``ManagedJobStatus`` (imported on first use: the local launcher never needs SkyPilot)."""
    from sky.jobs.state import ManagedJobStatus

    return ManagedJobStatus


def is_active(status: ManagedJobStatus) -> bool:
    """Not terminal: the job is (or will be) the worker."""
    return not status.is_terminal()


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
            f"managed job {name} (id {record.get('job_id')}) ended {getattr(self.status, 'value', self.status)} after "
            f"{record.get('recovery_count') or 0} recoveries: {reason}\n"
            f"--- last lines of its log ---\n{log_tail.rstrip() or '(no log)'}")


def parse_resources(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """What a SkyPilot record says a job (or cluster) runs on: cloud, region, zone, instance type,
    accelerators, spot, nodes; None before it has a cluster. The string is SkyPilot's own
    (``cluster_resources_full`` of a managed job, ``resources_str_full`` of a cluster); one it does not
    format that way is an error, never a guess (an on-demand price for a spot node, say)."""
    cloud = record.get("cloud")
    full = str(record.get("cluster_resources_full") or record.get("resources_str_full") or "").strip()
    if not cloud or cloud == "-" or not full or full == "-":
        return None
    m = RESOURCES.fullmatch(full)
    if m is None:
        raise ValueError(f"SkyPilot's resources string {full!r} is not in the form "
                         "resources_utils.get_readable_resources_repr writes ({nodes}x[spot](gpus=..., ...))")
    plain = [p.strip() for p in m["inside"].split(", ") if p.strip() and "=" not in p and p.strip() != "..."]
    return {"cloud": str(cloud), "region": record.get("region"), "zone": record.get("zone"),
            "instance_type": plain[0] if plain else None, "accelerators": dict(record.get("accelerators") or {}),
            "use_spot": m["spot"] is not None, "nodes": int(m["nodes"] or 1)}


def job_view(record: Mapping[str, Any]) -> dict[str, Any]:
    """A ``ManagedJobRecord`` as the pool reads it: status as ``ManagedJobStatus``, resources parsed (None
    with ``resources_error`` if SkyPilot's string cannot be read), the provisioning timestamps."""
    record = record if isinstance(record, Mapping) else record.model_dump()
    status = record.get("status")
    view = {"job_id": record.get("job_id"), "job_name": record.get("job_name"),
            "status": status if isinstance(status, job_status()) else job_status()(status),
            "recovery_count": record.get("recovery_count") or 0, "failure_reason": record.get("failure_reason"),
            **{k: record.get(k) for k in TIMESTAMPS}}
    try:
        view["resources"] = parse_resources(record)
    except ValueError as e:
        view["resources"], view["resources_error"] = None, str(e)
    return view


def controller_job_group(environ: Mapping[str, str] | None = None, api_version: int | None = None) -> int | None:
    """The managed job to attach a worker to (``sky.jobs.launch(job_group=...)``): the controller's own, when
    the flow runs inside one (``SKYPILOT_MANAGED_JOB_ID``) and the API server records attachments; then
    SkyPilot sweeps the workers when the controller job ends. None: a top-level job."""
    env = os.environ if environ is None else environ
    parent = env.get("SKYPILOT_MANAGED_JOB_ID", "")
    if not parent.isdigit():
        return None
    from sky.server.constants import MIN_JOBS_PARENT_LINK_API_VERSION

    if api_version is None:
        from sky.server import versions

        api_version = versions.get_remote_api_version()
    if api_version is None or api_version < MIN_JOBS_PARENT_LINK_API_VERSION:
        _logger().warning("the SkyPilot API server (API version %s) cannot attach jobs to a job group (needs %d): "
                          "the workers are top-level jobs, cancelled by the flow's hooks only", api_version,
                          MIN_JOBS_PARENT_LINK_API_VERSION)
        return None
    return int(parent)


def check_api_server(environ: Mapping[str, str] | None = None) -> None:
    """On the controller's VM (inside a managed job), SkyPilot calls must reach the API server the user
    launched it through: a local one there would be a private SkyPilot with no cloud credentials."""
    env = os.environ if environ is None else environ
    if not env.get("SKYPILOT_MANAGED_JOB_ID"):
        return
    from sky.server import common

    url = env.get("SKYPILOT_API_SERVER_ENDPOINT") or common.get_server_url()
    if common.is_api_server_local(url):
        raise RuntimeError(f"the controller runs in a SkyPilot managed job but its SkyPilot API server is {url}, "
                           "this VM's own: set SKYPILOT_API_SERVER_ENDPOINT to your remote API server (SkyPilot sets "
                           "it when the controller is launched through one; see docs/cloud.md)")


class SkyJobs:
    """The seam: SkyPilot's managed-jobs API (and ``sky.status`` for the controller's own cluster), and
    nothing else. ``records`` and ``cluster_record`` return SkyPilot's records as plain dicts."""

    def launch(self, task: Any, name: str) -> int:
        import sky

        job_ids, _ = sky.stream_and_get(sky.jobs.launch(task, name=name, job_group=controller_job_group()))
        if not job_ids:
            raise RuntimeError(f"sky.jobs.launch returned no job id for {name}")
        return int(job_ids[0])

    def records(self, name_match: str) -> list[dict[str, Any]]:
        """``sky.jobs.queue_v2`` records of the jobs whose name contains ``name_match`` (SkyPilot matches
        substrings; callers filter)."""
        import sky

        return [r if isinstance(r, dict) else r.model_dump()
                for r in sky.get(sky.jobs.queue_v2(refresh=False, name_match=name_match))[0]]

    def job_record(self, job_id: int) -> dict[str, Any] | None:
        """``sky.jobs.queue_v2``'s record of one managed job (the controller's own, when it runs as one)."""
        import sky

        found = sky.get(sky.jobs.queue_v2(refresh=False, job_ids=[job_id]))[0]
        return None if not found else (found[0] if isinstance(found[0], dict) else found[0].model_dump())

    def cluster_record(self, cluster_name: str) -> dict[str, Any] | None:
        """``sky.status``'s record of one cluster (the controller's own), or None if SkyPilot has none."""
        import sky

        found = sky.get(sky.status(cluster_names=[cluster_name], all_users=True))
        return None if not found else (found[0] if isinstance(found[0], dict) else found[0].model_dump())

    def queue(self, name_match: str) -> list[dict[str, Any]]:
        """The jobs of ``records`` as the pool reads them (:func:`job_view`)."""
        return [job_view(r) for r in self.records(name_match)]

    def cancel(self, name: str) -> None:
        import sky

        sky.get(sky.jobs.cancel(name=name))

    def logs(self, job_id: int, tail: int) -> str:
        import io

        import sky

        buf = io.StringIO()
        sky.jobs.tail_logs(job_id=job_id, follow=False, tail=tail, output_stream=buf)
        return buf.getvalue()


def job_name(run_url: str, kind: str, index: int) -> str:
    """Deterministic managed-job name: the same worker of the same run always has the same name."""
    return f"{run_prefix(run_url)}{kind}-{index:04d}"


def run_prefix(run_url: str) -> str:
    """``spotlight-<run>-<hash of the URL>-``: a readable, unique, lowercase name prefix for a run."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_url.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:20] or "run"
    return f"spotlight-{slug}-{hashlib.sha256(run_url.rstrip('/').encode()).hexdigest()[:6]}-"


def check_sequence_parallel_gpus(cfg: Config) -> None:
    """An SP explorer runs one member per GPU of its node, so each candidate node has ``degree`` GPUs:
    fewer never form a full group, more sit as spares."""
    degree = cfg.placement.sequence_parallel.degree
    wrong = [a for a in cfg.placement.explorer.accelerators if degree > 1 and int(a.split(":")[1]) != degree]
    if wrong:
        raise ValueError(f"placement.sequence_parallel.degree is {degree}, but placement.explorer.accelerators "
                         f"{wrong} do not have {degree} GPUs each (an SP explorer runs one member per GPU); "
                         f"use e.g. [H100:{degree}, A100-80GB:{degree}]")


class LocalLauncher:
    """The embedded default: workers are processes on this machine (``tasks/workers.py``)."""


class SkyLauncher:
    """Workers as SkyPilot managed jobs (read everything they do from the store)."""

    def __init__(self, jobs: SkyJobs | None = None, sky_dir: Path = SKY_DIR, poll_seconds: float = 15.0,
                 log_tail_lines: int = 40, environ: Mapping[str, str] | None = None):
        self.jobs = jobs or SkyJobs()
        self.sky_dir, self.poll_seconds, self.log_tail_lines = Path(sky_dir), poll_seconds, log_tail_lines
        self.environ = os.environ if environ is None else environ
        self.launched: list[str] = []  # job names this launcher launched, in order (relaunches included)
        self._warned_expiry = False

    # -- what to launch ------------------------------------------------------------------------
    def secrets(self) -> dict[str, str]:
        """AWS credentials from the standard chain (env, ~/.aws, instance role), with the session token of
        temporary ones; the endpoint if set. Read at each launch, so a relaunched worker gets the credentials
        the controller has then (refreshed, if its chain refreshes them: an instance role, SSO)."""
        values = {k: self.environ[k] for k in (*REQUIRED_SECRETS, "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL")
                  if self.environ.get(k)}
        expiry = credential_expiry(self.environ)
        if not all(k in values for k in REQUIRED_SECRETS):
            import botocore.session

            creds = botocore.session.get_session().get_credentials()
            if creds is None:
                raise RuntimeError("launching a worker on SkyPilot needs AWS credentials for the run store "
                                   f"({' and '.join(REQUIRED_SECRETS)} in the environment, or ~/.aws); none found")
            frozen = creds.get_frozen_credentials()
            values.update(AWS_ACCESS_KEY_ID=frozen.access_key, AWS_SECRET_ACCESS_KEY=frozen.secret_key)
            if frozen.token:
                values["AWS_SESSION_TOKEN"] = frozen.token
                expiry = getattr(creds, "_expiry_time", None) or expiry  # botocore's refreshable credentials
        if "AWS_SESSION_TOKEN" in values:
            self._check_expiry(expiry)
        return values

    def _check_expiry(self, expiry: datetime.datetime | None) -> None:
        """Temporary credentials (a session token) end: refuse ones about to, and say when the others do."""
        left = None if expiry is None else (expiry - datetime.datetime.now(datetime.timezone.utc)).total_seconds()
        if left is not None and left < MIN_CREDENTIAL_SECONDS:
            raise RuntimeError(f"the AWS session token expires at {expiry:%Y-%m-%d %H:%M} UTC, in {max(left, 0) / 60:.0f} "
                               "min: a worker launched with it would soon lose the run store. Refresh the credentials "
                               "(aws sso login, aws sts assume-role) and run again, or use long-lived keys or an "
                               "instance role (docs/cloud.md)")
        if not self._warned_expiry:
            self._warned_expiry = True
            when = "at an unknown time" if left is None else \
                f"at {expiry:%Y-%m-%d %H:%M} UTC (in {left / 3600:.1f} h)"
            _logger().warning("the workers get temporary AWS credentials (AWS_SESSION_TOKEN) that expire %s: a worker "
                              "running then fails on the run store (ExpiredToken) and is relaunched with the "
                              "credentials the controller has then; for a longer run use long-lived keys or an "
                              "instance role (docs/cloud.md)", when)

    def build_task(self, kind: str, index: int, config: dict[str, Any]) -> Any:
        """The kind's worker task: its YAML, resources from placement, the run's envs and the secrets,
        parsed by SkyPilot itself (``sky.Task.from_yaml_config``, as ``sky jobs launch`` does)."""
        import sky

        cfg = config_from_dict(config)
        if not cfg.run_url.startswith(("s3://", "gs://", "r2://")):
            raise ValueError(f"a {kind} on SkyPilot needs a bucket run store (s3://...), but the run is "
                             f"{cfg.run_url}: a cloud VM cannot see this machine's disk")
        raw = worker_task_config(kind, cfg, self.sky_dir)
        # errors are the pool's to count and relaunch (placement.max_relaunches); SkyPilot's restarts on
        # errors would multiply them (EAGER_NEXT_REGION re-provisions for a restart just as for a relaunch)
        raw["resources"]["job_recovery"] = {**(raw["resources"].get("job_recovery") or {}), "max_restarts_on_errors": 0}
        envs = {"RUN_URL": cfg.run_url, "SPOTLIGHT_SLOT": job_name(cfg.run_url, kind, index),
                "IDLE_EXIT": f"{cfg.placement.idle_exit_seconds:g}",
                "SP_DEGREE": str(cfg.placement.sequence_parallel.degree)}
        if kind == "explorer":
            check_sequence_parallel_gpus(cfg)
        # As `sky jobs launch --env K=V --secret K` does: overrides go in before SkyPilot turns
        # null-valued secrets into managed-secret references.
        task = sky.Task.from_yaml_config(
            raw, env_overrides=[(k, v) for k, v in envs.items() if k in (raw.get("envs") or {})],
            secrets_overrides=list(self.secrets().items()))
        missing = [k for k, v in task.envs.items() if v == "" and k == "RUN_URL"]
        if missing:
            raise ValueError(f"{WORKER_YAMLS[kind]}: required envs {missing} are not set by the launcher")
        if task.workdir == ".":
            task.workdir = str(self.sky_dir.parent)
        return task

    # -- launching -----------------------------------------------------------------------------
    def latest(self, name: str, records: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
        """The newest job with exactly this name (SkyPilot's name filter matches substrings)."""
        mine = [r for r in (self.jobs.queue(name) if records is None else records) if r["job_name"] == name]
        return max(mine, key=lambda r: r["job_id"]) if mine else None

    def start(self, kind: str, index: int, config: dict[str, Any], relaunch: bool = False) -> tuple[str, int]:
        """Launch the worker's job unless one of that name is active (returns its id either way).
        ``relaunch``: the pool saw the previous job end while the run needs the worker."""
        if kind not in WORKER_YAMLS:
            raise ValueError(f"no SkyPilot task for worker kind {kind!r}; kinds: {', '.join(WORKER_YAMLS)}")
        log = _logger()
        name = job_name(config_from_dict(config).run_url, kind, index)
        existing = self.latest(name)
        if existing is not None and is_active(existing["status"]):
            log.info("managed job %s (id %s) is %s: it is the %s, not launching another",
                     name, existing["job_id"], existing["status"].value, kind)
            return name, existing["job_id"]
        task = self.build_task(kind, index, config)  # errors here launch nothing
        try:
            job_id = self.jobs.launch(task, name)
        except BaseException:
            _logger().warning("interrupted while launching %s; cancelling the managed job", name)
            self.jobs.cancel(name)  # it may have been submitted before the interrupt
            raise
        self.launched.append(name)
        log.info("%s managed job %s (id %s): a %s, resources %s, secrets %s (values not shown); "
                 "SKYPILOT_TASK_ID names it across spot recoveries", "relaunched" if relaunch else "launched",
                 name, job_id, kind, [str(r) for r in task.resources], sorted(task.secrets))
        return name, job_id

    def controller_instance(self) -> dict[str, Any]:
        """The VM this flow runs on, priced from SkyPilot's record of it: its managed job's
        (``SKYPILOT_MANAGED_JOB_ID``: the controller launched with ``sky jobs launch``, whose cluster
        ``sky.status`` does not list), else its cluster's (``SKYPILOT_CLUSTER_INFO``, which SkyPilot gives
        every task, names it); this machine at $0 when the flow does not run on SkyPilot (a laptop), and $0
        with the reason when the record cannot be priced."""
        import json
        import socket

        from spotlight.cost import PriceError, resources_price

        info, job_id = self.environ.get("SKYPILOT_CLUSTER_INFO"), self.environ.get("SKYPILOT_MANAGED_JOB_ID", "")
        if not info:
            return {"instance": f"local {socket.gethostname()}", "price_per_hour": 0.0,
                    "price_source": "not a SkyPilot cluster (no SKYPILOT_CLUSTER_INFO): this machine"}
        name = f"managed job {job_id}" if job_id.isdigit() else json.loads(info)["cluster_name"]
        try:
            record = self.jobs.job_record(int(job_id)) if job_id.isdigit() else self.jobs.cluster_record(name)
            resources = parse_resources(record) if record else None
            if resources is None:
                raise PriceError(f"SkyPilot has no record of the cluster {name}")
            return {**resources_price(resources), "resources": resources}
        except (PriceError, ValueError) as e:
            _logger().warning("the controller's own VM cannot be priced: %s", e)
            return {"instance": f"SkyPilot cluster {name}", "price_per_hour": 0.0, "price_source": f"unpriced: {e}"}

    def failure(self, name: str, record: Mapping[str, Any]) -> SkyJobFailed:
        return SkyJobFailed(name, record, self._redact(self.jobs.logs(record["job_id"], self.log_tail_lines)))

    def cancel_run(self, run_url: str) -> list[str]:
        """Cancel every active managed job of a run (names with the run's prefix); returns their names."""
        prefix = run_prefix(run_url)
        cancelling = job_status().CANCELLING
        names = sorted({r["job_name"] for r in self.jobs.queue(prefix)
                        if r["job_name"].startswith(prefix) and is_active(r["status"]) and r["status"] != cancelling})
        for name in names:
            self.jobs.cancel(name)
        return names

    def _redact(self, text: str) -> str:
        """Job logs are the user's output; still, never echo a credential this controller holds."""
        for key in (*REQUIRED_SECRETS, "AWS_SESSION_TOKEN", "PREFECT_API_KEY"):
            value = self.environ.get(key)
            if value and len(value) >= 8:
                text = text.replace(value, "***")
        return text


MIN_CREDENTIAL_SECONDS = 600.0  # temporary credentials closer than this to their expiry launch nothing


def credential_expiry(environ: Mapping[str, str]) -> datetime.datetime | None:
    """When the temporary AWS credentials of the environment expire: ``AWS_CREDENTIAL_EXPIRATION`` (ISO 8601,
    as ``aws configure export-credentials --format env`` and aws-vault set it); None if not given."""
    value = environ.get("AWS_CREDENTIAL_EXPIRATION")
    if not value:
        return None
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"AWS_CREDENTIAL_EXPIRATION={value!r} is not an ISO 8601 time") from None
    return when if when.tzinfo else when.replace(tzinfo=datetime.timezone.utc)


def sky_jobs_from_env(environ: Mapping[str, str] | None = None) -> SkyJobs:
    """SkyPilot's jobs API, or the implementation ``SPOTLIGHT_SKY_JOBS=module:attribute`` names."""
    spec = (environ if environ is not None else os.environ).get("SPOTLIGHT_SKY_JOBS")
    if not spec:
        return SkyJobs()
    module, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"SPOTLIGHT_SKY_JOBS={spec!r}: expected module:attribute")
    return getattr(importlib.import_module(module), attr)()


def launcher_from_env(environ: Mapping[str, str] | None = None) -> LocalLauncher | SkyLauncher:
    """``SPOTLIGHT_LAUNCHER=sky`` -> SkyLauncher; unset or ``local`` -> LocalLauncher."""
    env = environ if environ is not None else os.environ
    kind = env.get("SPOTLIGHT_LAUNCHER", "local")
    if kind == "local":
        return LocalLauncher()
    if kind == "sky":
        poll = float(env.get("SPOTLIGHT_POOL_POLL_SECONDS", "15"))
        jobs = sky_jobs_from_env(env)
        if type(jobs) is SkyJobs:
            check_api_server(env)
        return SkyLauncher(jobs=jobs, poll_seconds=poll)
    raise ValueError(f"SPOTLIGHT_LAUNCHER={kind!r}: expected 'local' or 'sky'")

