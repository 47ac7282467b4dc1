"""An emulated SkyPilot managed-jobs controller: the ``SkyJobs`` seam, each job a real local process.

The flow's controller (``spotlight run`` with ``SPOTLIGHT_LAUNCHER=sky``) loads this class through
``SPOTLIGHT_SKY_JOBS=tests.emulated_cluster:EmulatedSkyJobs``; everything above the seam is the real
code (the pool, the launcher building the task from ``sky/<kind>.yaml`` with SkyPilot's own parser, the
placement's resources and mounts), and everything below it is a real process of the task: its
``file_mounts`` copied from the (moto) S3 buckets to their paths, its ``setup:`` script (with ``pip`` a
no-op: this machine has the project installed), then its ``run:`` script, with the environment SkyPilot
gives a managed job (the task's envs and secrets, ``SKYPILOT_TASK_ID`` stable across recoveries,
``SKYPILOT_CLUSTER_INFO``, the node variables). Each emulated VM has its own ``/tmp`` (``TMPDIR``, under
the logdir), which its setup and run share and a recovered VM does not inherit.

Job states follow ``sky/jobs/controller.py`` (``_monitor_one_task_impl``), with SkyPilot's own
``ManagedJobStatus`` and its own recovery decision (``StrategyExecutor.should_restart_on_failure``,
made from the task's ``job_recovery`` by ``StrategyExecutor.make``):

* PENDING -> STARTING (``submitted_at``) -> provisioning -> RUNNING (``start_at``, ``last_recovered_at``);
* the process exits 0: SUCCEEDED, whatever happens to its VM next (so a preempted worker that exited
  0 would never be recovered);
* it exits non-zero: after SkyPilot's grace the VM is looked at. Gone (preempted): RECOVERING. Still up:
  ``should_restart_on_failure(exit_codes=[rc])``: RECOVERING if ``recover_on_exit_codes`` lists the code
  or ``max_restarts_on_errors`` is not used up, else FAILED;
* the VM goes while the process runs: RECOVERING;
* recovery is EAGER_NEXT_REGION's: the cluster is torn down, ``recovery_seconds`` later the job runs
  again (same ``SKYPILOT_TASK_ID``) in the next zone that has capacity then; RUNNING, the running time
  added to ``job_duration``, ``recovery_count`` + 1 (``sky/jobs/state.py``).

Spot capacity comes from the real traces in ``sky/traces`` (time-compressed): a job holds its VM while
its zone's trace holds capacity; at a drop the VM is preempted (SIGTERM, the VM gone ``grace_seconds``
later, the process killed -9 if it still runs). Records carry what SkyPilot's carry, the resources
string formatted by SkyPilot's own function (``tests/sky_records.py``), and ``cluster_record`` answers
for the controller's own VM.

The spec is a JSON file named by ``EMULATED_CLUSTER``::

    {"traces": DIR, "compress": trace seconds per real second, "recovery_seconds": real seconds,
     "provision_seconds": launch -> RUNNING, "grace_seconds": SIGTERM -> VM gone,
     "check_seconds": the controller's look at each job, "failure_grace_seconds": non-zero exit -> VM check,
     "preempt_window_seconds": no preemption after this (real, from launch),
     "logdir": DIR (job logs and events.jsonl),
     "jobs": {"<kind>-<index>": {"zone": "us-west-2b", "start_tick": 1234,
                                 "accelerators": ["A10G"] (the candidates with capacity for it; default all)}},
     "controller": {"cluster": NAME, "region": "us-east-1", "instance_type": "m6i.large"}}
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotlight.catalog import accelerator_price
from spotlight.forecast.errors import ForecastError
from spotlight.forecast.traces import Trace, load_trace
from spotlight.queue_worker import term_with_parent
from tasks.launcher import SkyJobs, job_status
from tests.sky_records import resources_string, seed_catalog

PASSED_ENV = ("HOME", "PYTHONPATH", "OMP_NUM_THREADS", "TMPDIR", "LANG", "LC_ALL", "AWS_DEFAULT_REGION",
              "PYTHONUNBUFFERED", "SKYPILOT_DISABLE_USAGE_COLLECTION", "SPOTLIGHT_POLL_SECONDS")
DEFAULTS = {"provision_seconds": 0.0, "check_seconds": 0.2, "failure_grace_seconds": 0.5}


class EmulationError(ForecastError):
    """A bad emulated-cluster spec or trace; the message names it."""


# -- capacity from the traces ------------------------------------------------------------------
def held_end(trace: Trace, tau: float) -> float | None:
    """When the capacity held at trace time ``tau`` drops (the trace wraps around), or None if not held."""
    period, x = trace.period, tau % trace.period
    runs = trace.held_runs
    for a, b in runs:
        if a <= x < b:
            end = tau - x + b
            if b == period and runs[0][0] == 0:  # held across the wrap: one interval
                end += runs[0][1] if runs[0][1] < period else math.inf
            return end
    return None


def next_held(trace: Trace, tau: float) -> float:
    """The first trace time >= tau at which capacity is held."""
    x = tau % trace.period
    starts = [a for a, _ in trace.held_runs if a >= x]
    return tau - x + (min(starts) if starts else trace.period + trace.held_runs[0][0])


@dataclass(frozen=True)
class Segment:
    """The job holds a VM in ``zone`` from ``start`` to ``end`` (real seconds after launch)."""

    zone: str
    region: str
    start: float
    end: float  # inf: never preempted (after the window)


def next_segment(traces: list[Trace], first: str, tau0: float, now: float, compress: float,
                 window_seconds: float) -> Segment:
    """Where a job that looks for capacity at ``now`` (real seconds after launch; trace time
    ``tau0 + now * compress``) runs next: the first zone, ``first`` and then the next ones in order, that
    holds capacity then (or the first to get it), until that zone's trace drops."""
    by_zone, order = {t.zone: t for t in traces}, [t.zone for t in traces]
    if first not in by_zone:
        raise EmulationError(f"no spot trace for zone {first!r}; zones: {', '.join(by_zone)}")
    candidates = [order[(order.index(first) + k) % len(order)] for k in range(len(order))]
    tau = tau0 + now * compress
    held = [(z, held_end(by_zone[z], tau)) for z in candidates]
    found = next(((z, end) for z, end in held if end is not None), None)
    if found is None:  # no zone has capacity now: wait for the first that does
        start = min(next_held(by_zone[z], tau) for z in candidates)
        return next_segment(traces, first, tau0, (start - tau0) / compress, compress, window_seconds)
    zone, end = found
    drop = (end - tau0) / compress
    return Segment(zone, by_zone[zone].region, now, math.inf if drop >= window_seconds else drop)


def capacity_schedule(traces: list[Trace], zone: str, start_tick: int, compress: float, recovery_seconds: float,
                      window_seconds: float, limit: int = 1000) -> list[Segment]:
    """A job's held segments under EAGER_NEXT_REGION if it were recovered ``recovery_seconds`` after each
    drop: it runs in a zone until that zone's trace drops, then in the first zone (the next ones first)
    whose trace holds capacity. The plan the test checks its preemptions against."""
    by_zone = {t.zone: t for t in traces}
    if zone not in by_zone:
        raise EmulationError(f"no spot trace for zone {zone!r}; zones: {', '.join(by_zone)}")
    trace, order = by_zone[zone], [t.zone for t in traces]
    if not 0 <= start_tick < len(trace.values):
        raise EmulationError(f"start_tick {start_tick} is outside the trace of {zone} (0..{len(trace.values) - 1})")
    tau0, now, first, segments = start_tick * trace.gap_seconds, 0.0, zone, []
    while len(segments) < limit:
        segment = next_segment(traces, first, tau0, now, compress, window_seconds)
        segments.append(segment)
        if math.isinf(segment.end):
            break
        now, first = segment.end + recovery_seconds, order[(order.index(segment.zone) + 1) % len(order)]
    return segments


def load_spec(path: str | os.PathLike) -> dict[str, Any]:
    where = f"emulated cluster spec {path}"
    if not Path(path).is_file():
        raise EmulationError(f"{where}: no such file")
    try:
        spec = {**DEFAULTS, **json.loads(Path(path).read_text())}
    except json.JSONDecodeError as e:
        raise EmulationError(f"{where}: not valid JSON ({e})") from None
    for key in ("traces", "compress", "recovery_seconds", "grace_seconds", "preempt_window_seconds", "logdir", "jobs"):
        if key not in spec:
            raise EmulationError(f"{where}: missing {key!r}")
    directory = Path(spec["traces"])
    if not directory.is_dir():
        raise EmulationError(f"{where}: trace folder {directory}: no such folder")
    zones = {j["zone"] for j in spec["jobs"].values()}
    paths = {p.stem.split("_")[0]: p for p in sorted(directory.glob("*.json"))}
    missing = sorted(zones - set(paths))
    if missing:
        raise EmulationError(f"{where}: no spot trace for zone(s) {', '.join(missing)} in {directory}")
    try:
        spec["_traces"] = [load_trace(p) for p in paths.values()]  # a malformed trace fails here, naming it
    except ForecastError as e:
        raise EmulationError(f"{where}: {e}") from None
    return spec


# -- one managed job ----------------------------------------------------------------------------------
class _Job:
    """One managed job: its record (SkyPilot's fields), and the thread that is its jobs controller."""

    def __init__(self, cluster: "EmulatedSkyJobs", job_id: int, name: str, task: Any, slot: str):
        from sky import backends
        from sky.jobs.recovery_strategy import StrategyExecutor

        self.cluster, self.job_id, self.name, self.task, self.slot = cluster, job_id, name, task, slot
        spec = cluster.spec
        job = spec["jobs"].get(slot)
        if job is None:
            raise EmulationError(f"emulated cluster spec has no schedule for {slot!r}; jobs: {', '.join(spec['jobs'])}")
        traces = {t.zone: t for t in spec["_traces"]}
        if job["zone"] not in traces:
            raise EmulationError(f"no spot trace for zone {job['zone']!r}; zones: {', '.join(traces)}")
        self.zone, self.tau0 = job["zone"], int(job["start_tick"]) * traces[job["zone"]].gap_seconds
        self.allowed = job.get("accelerators")
        self.status = job_status().PENDING
        self.recovery_count, self.failure_reason, self.job_duration = 0, None, 0.0
        self.submitted_at = self.start_at = self.end_at = self.last_recovered_at = None
        self.where: dict[str, Any] | None = None  # cloud, region, zone, accelerators, cluster_resources_full
        self.cancel = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.vm_gone_at = math.inf  # real seconds after launch when the current VM stops existing
        self.launched = time.monotonic()
        self.task_id = f"sky-managed-{time.strftime('%Y-%m-%d-%H-%M-%S')}_{name}_{job_id}-0"
        # SkyPilot's own strategy for this task's job_recovery (it strips job_recovery from what it is given)
        self.executor = StrategyExecutor.make(f"{name}-{job_id}", backends.CloudVmRayBackend(), copy.deepcopy(task),
                                              job_id, 0, None, set(), asyncio.Lock(), asyncio.Condition())
        self.log = Path(spec["logdir"]) / f"{name}-{job_id}.log"
        self.thread = threading.Thread(target=self._control, name=f"job-{name}", daemon=True)

    def record(self) -> dict[str, Any]:
        """What ``sky.jobs.queue_v2`` returns for the job (``ManagedJobRecord`` fields)."""
        where = self.where or {"cloud": None, "region": None, "zone": None, "accelerators": None,
                               "cluster_resources_full": None}
        return {"job_id": self.job_id, "job_name": self.name, "status": self.status,
                "recovery_count": self.recovery_count, "failure_reason": self.failure_reason,
                "submitted_at": self.submitted_at, "start_at": self.start_at, "end_at": self.end_at,
                "last_recovered_at": self.last_recovered_at, "job_duration": self.job_duration, **where}

    def _now(self) -> float:
        return time.monotonic() - self.launched

    # -- the VM ---------------------------------------------------------------------------------------
    def _provision(self, segment: Segment) -> None:
        """The cheapest offer among the task's candidates that have capacity for this job in the segment's
        region (as the optimizer picks), described as SkyPilot's record describes a launched cluster."""
        offers = []
        for r in self.task.resources:
            (name, count), = r.accelerators.items()
            if self.allowed is not None and name not in self.allowed:
                continue
            try:
                instance, price = accelerator_price(f"{name}:{int(count)}", "aws", segment.region, bool(r.use_spot))
            except Exception:  # noqa: BLE001 - not offered in this region
                continue
            offers.append((price, instance, name, int(count), bool(r.use_spot)))
        if not offers:
            raise EmulationError(f"no catalog offer for {self.name} in {segment.region}")
        _, instance, name, count, spot = min(offers)
        self.where = {"cloud": "AWS", "region": segment.region, "zone": segment.zone, "accelerators": {name: count},
                      "cluster_resources_full": resources_string("AWS", segment.region, segment.zone, instance,
                                                                 f"{name}:{count}", spot, self.task.num_nodes)}
        self.vm_gone_at = math.inf if math.isinf(segment.end) else segment.end + float(self.cluster.spec["grace_seconds"])

    def _env(self, segment: Segment) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env["PATH"] = f"{self.cluster.shims}:{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        env.update({k: str(v) for k, v in self.task.envs.items()})
        env.update({k: v.get_secret_value() if hasattr(v, "get_secret_value") else str(v)
                    for k, v in self.task.secrets.items()})
        env.update(SKYPILOT_TASK_ID=self.task_id, SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0",
                   SKYPILOT_NODE_IPS="127.0.0.1", SKYPILOT_NUM_GPUS_PER_NODE="1",
                   SKYPILOT_CLUSTER_INFO=json.dumps({"cluster_name": f"{self.name}-{self.job_id}", "cloud": "AWS",
                                                     "region": segment.region, "zone": segment.zone}))
        return env

    def _mount(self) -> None:
        """The task's bucket mounts, emulated by a copy from S3 (the moto server) to their paths. The emulated
        VMs share this machine's disk: each copy lands in a folder of its own and its files are moved into
        place one by one (atomically), so a worker already reading a mounted file never sees it missing."""
        import fsspec

        from spotlight.store import s3_storage_options

        for path, storage in self.task.storage_mounts.items():
            fs, root = fsspec.core.url_to_fs(storage.source, **s3_storage_options())
            Path(path).mkdir(parents=True, exist_ok=True)
            fresh = Path(tempfile.mkdtemp(dir=Path(path).parent, prefix=".mount-"))
            try:
                fs.get(root.rstrip("/") + "/", f"{fresh}/", recursive=True)
                for file in sorted(f for f in fresh.rglob("*") if f.is_file()):
                    target = Path(path) / file.relative_to(fresh)
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(file, target)
            finally:
                shutil.rmtree(fresh, ignore_errors=True)
            self.cluster.event("mount", self, path=path, source=storage.source, mode=storage.mode.value)

    def _start(self, segment: Segment) -> bool:
        """Mount, set up and run the task on the segment's VM; whether setup succeeded."""
        self._mount()
        env = {**self._env(segment), "TMPDIR": tempfile.mkdtemp(dir=self.cluster.vm_tmp, prefix=f"{self.name}-")}
        with open(self.log, "ab") as out:
            setup = subprocess.run(["bash", "-c", self.task.setup or "true"], cwd=self.task.workdir, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
            if setup.returncode != 0:
                return False
            self.proc = subprocess.Popen(["bash", "-c", self.task.run], cwd=self.task.workdir, env=env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=term_with_parent)
        self.cluster.event("start", self, zone=segment.zone, pid=self.proc.pid)
        return True

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def _teardown(self) -> None:
        """The cluster is terminated: whatever still runs on it is gone."""
        self._signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    # -- the controller ---------------------------------------------------------------------------------
    def _set(self, status: str, **fields: Any) -> None:
        self.status = getattr(job_status(), status)
        for key, value in fields.items():
            setattr(self, key, value)

    def _wait(self, seconds: float) -> bool:
        """Sleep, unless the job is cancelled (True)."""
        return self.cancel.wait(max(0.0, seconds))

    def _control(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - the emulated controller failed: as SkyPilot says it
            self._teardown()
            self._set("FAILED_CONTROLLER", failure_reason=f"emulated controller: {e!r}", end_at=time.time())
            self.cluster.event("controller-error", self, error=repr(e))

    def _run(self) -> None:
        spec, traces = self.cluster.spec, self.cluster.spec["_traces"]
        order = [t.zone for t in traces]
        self._set("STARTING", submitted_at=time.time())
        first, recovering = self.zone, False
        while True:
            # launch (or recover into) the first zone with capacity, after the provisioning time
            if self._wait(float(spec["provision_seconds"])):
                return self._cancelled()
            segment = next_segment(traces, first, self.tau0, self._now(), float(spec["compress"]),
                                   float(spec["preempt_window_seconds"]))
            if self._wait(segment.start - self._now()):
                return self._cancelled()
            self._provision(segment)
            if recovering:  # set_recovered_async
                self._set("RUNNING", last_recovered_at=time.time(), recovery_count=self.recovery_count + 1)
            else:  # set_started_async
                now = time.time()
                self._set("RUNNING", start_at=now, last_recovered_at=now)
            if not self._start(segment):
                self._set("FAILED_SETUP", failure_reason="setup failed", end_at=time.time())
                return self.cluster.event("failed-setup", self)
            preempted = False
            while True:  # the monitor loop: one look per check_seconds
                if self._wait(float(spec["check_seconds"])):
                    return self._cancelled()
                if not preempted and self._now() >= segment.end:  # the preemption: SIGTERM, then the VM goes
                    preempted = True
                    self._signal(signal.SIGTERM)
                    self.cluster.event("preempt", self, zone=segment.zone)
                rc = self.proc.poll()
                vm_up = self._now() < self.vm_gone_at
                if rc == 0:  # SkyPilot: the job SUCCEEDED, whatever happens to its VM next
                    self._set("SUCCEEDED", end_at=time.time())
                    self._teardown()
                    return self.cluster.event("exit", self, rc=0, preempted=preempted)
                if rc is None and vm_up:
                    continue
                if rc is not None:  # a user-code failure: SkyPilot's grace, then the VM's status
                    self.cluster.event("error-exit", self, rc=rc, preempted=preempted)
                    if self._wait(float(spec["failure_grace_seconds"])):
                        return self._cancelled()
                    vm_up = self._now() < self.vm_gone_at
                    if vm_up and not self.executor.should_restart_on_failure(exit_codes=[rc]):
                        self._set("FAILED", failure_reason=f"Job exited with exit code {rc} (user program failure)",
                                  end_at=time.time())
                        self._teardown()
                        return self.cluster.event("failed", self, rc=rc)
                break  # the VM is gone, or SkyPilot restarts the job: RECOVERING
            # set_recovering_async: the running time so far joins job_duration
            self._set("RECOVERING", job_duration=self.job_duration + time.time() - self.last_recovered_at)
            self._teardown()
            self.cluster.event("recovering", self, how="preempted" if self._now() >= self.vm_gone_at else "restart")
            if self._wait(float(spec["recovery_seconds"])):
                return self._cancelled()
            first, recovering = order[(order.index(segment.zone) + 1) % len(order)], True  # EAGER_NEXT_REGION

    def _cancelled(self) -> None:
        self._set("CANCELLING")
        self._signal(signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=float(self.cluster.spec["grace_seconds"]))
            except subprocess.TimeoutExpired:
                pass
        self._teardown()
        self._set("CANCELLED", end_at=time.time())
        self.cluster.event("cancel", self)


# -- the seam ------------------------------------------------------------------------------------
class EmulatedSkyJobs(SkyJobs):
    """``SkyJobs`` whose jobs are local processes preempted on a real trace's schedule."""

    def __init__(self, spec_path: str | None = None):
        self.spec = load_spec(spec_path or os.environ["EMULATED_CLUSTER"])
        logdir = Path(self.spec["logdir"])
        logdir.mkdir(parents=True, exist_ok=True)
        seed_catalog(Path.home())  # SkyPilot formats records from its catalog: the shipped snapshot, offline
        self.shims = logdir / "shims"  # setup's `pip install`: the project is installed on this machine
        self.shims.mkdir(exist_ok=True)
        self.vm_tmp = logdir / "vm-tmp"  # each emulated VM's /tmp (TMPDIR), so that nothing lands in this machine's
        self.vm_tmp.mkdir(exist_ok=True)
        (self.shims / "pip").write_text("#!/bin/sh\necho \"emulated cluster: pip $*: already installed\"\n")
        (self.shims / "pip").chmod(0o755)
        self.jobs: list[_Job] = []
        self._lock = threading.Lock()

    def event(self, what: str, job: _Job, **extra: Any) -> None:
        line = {"event": what, "job": job.name, "job_id": job.job_id, "slot": job.slot, "t": time.time(),
                "recovery_count": job.recovery_count, "status": job.status.value, **extra}
        with self._lock, open(Path(self.spec["logdir"]) / "events.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")

    def launch(self, task: Any, name: str) -> int:
        slot = "-".join(name.rsplit("-", 2)[-2:])  # ...-trainer-0000 -> trainer-0000
        kind, index = slot.rsplit("-", 1)
        with self._lock:
            job = _Job(self, len(self.jobs) + 1, name, task, f"{kind}-{int(index)}")
            self.jobs.append(job)
        self.event("launch", job)
        job.thread.start()
        return job.job_id

    def records(self, name_match: str) -> list[dict[str, Any]]:
        with self._lock:
            return [j.record() for j in self.jobs if name_match in j.name]

    def cluster_record(self, cluster_name: str) -> dict[str, Any] | None:
        """``sky.status``'s record of the controller's VM (the spec's ``controller``), formatted by SkyPilot."""
        vm = self.spec.get("controller")
        if vm is None or vm["cluster"] != cluster_name:
            return None
        return {"name": cluster_name, "cloud": "AWS", "region": vm["region"], "zone": None, "nodes": 1,
                "resources_str_full": resources_string("AWS", vm["region"], None, vm["instance_type"], None, False,
                                                       disk_size=256)}

    def cancel(self, name: str) -> None:
        with self._lock:
            jobs = [j for j in self.jobs if j.name == name]
        for job in jobs:
            job.cancel.set()
        for job in jobs:
            job.thread.join(timeout=30)

    def logs(self, job_id: int, tail: int) -> str:
        job = next(j for j in self.jobs if j.job_id == job_id)
        try:
            return "\n".join(job.log.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""


def read_events(logdir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(logdir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
