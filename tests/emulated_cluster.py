"""An emulated SkyPilot managed-jobs controller: the ``SkyJobs`` seam, each job a real local process.

The flow's controller (``spotlight run`` with ``SPOTLIGHT_LAUNCHER=sky``) loads this class through
``SPOTLIGHT_SKY_JOBS=tests.emulated_cluster:EmulatedSkyJobs``; everything above the seam is the real
code (the pool, the launcher building the task from ``sky/<kind>.yaml`` with SkyPilot's own parser, the
placement's resources), and everything below it is a real process: ``bash -c`` with the task's own
``run:`` script (``exec spotlight worker ...``) and the environment SkyPilot gives a managed job (the
task's envs and secrets, ``SKYPILOT_TASK_ID`` stable across recoveries, ``SKYPILOT_CLUSTER_INFO``).
``setup:`` (pip install) is skipped: this machine has the project installed.

Spot capacity comes from the real traces in ``sky/traces`` (time-compressed): a job holds its instance
while its zone's trace holds capacity; at a drop it is preempted (SIGTERM, a grace period, then kill -9
if it is still alive), then recovered as ``job_recovery: EAGER_NEXT_REGION`` does: after
``recovery_seconds`` it is relaunched (same ``SKYPILOT_TASK_ID``) in the next zone that has capacity at
that moment of the trace, starting with the next one in order. A job that exits 0 is SUCCEEDED; one that
exits non-zero is restarted up to ``max_restarts_on_errors`` times, then FAILED.

The spec is a JSON file named by ``EMULATED_CLUSTER``::

    {"traces": DIR, "compress": trace seconds per real second, "recovery_seconds": real seconds,
     "grace_seconds": SIGTERM -> kill -9, "preempt_window_seconds": no preemption after this (real, from launch),
     "logdir": DIR (job logs and events.jsonl),
     "jobs": {"<kind>-<index>": {"zone": "us-west-2b", "start_tick": 1234}, ...}}
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spotlight.catalog import accelerator_price
from spotlight.forecast.errors import ForecastError
from spotlight.forecast.traces import Trace, load_trace
from tasks.launcher import SkyJobs

PASSED_ENV = ("HOME", "PYTHONPATH", "OMP_NUM_THREADS", "TMPDIR", "LANG", "LC_ALL", "AWS_DEFAULT_REGION",
              "PYTHONUNBUFFERED", "SKYPILOT_DISABLE_USAGE_COLLECTION", "SPOTLIGHT_POLL_SECONDS")


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
    """The job holds an instance in ``zone`` from ``start`` to ``end`` (real seconds after launch)."""

    zone: str
    region: str
    start: float
    end: float  # inf: never preempted (after the window)


def capacity_schedule(traces: list[Trace], zone: str, start_tick: int, compress: float, recovery_seconds: float,
                      window_seconds: float, limit: int = 1000) -> list[Segment]:
    """A job's held segments under EAGER_NEXT_REGION: it runs in a zone until that zone's trace drops,
    then, ``recovery_seconds`` later, in the first zone (the next ones first) whose trace holds capacity."""
    by_zone = {t.zone: t for t in traces}
    if zone not in by_zone:
        raise EmulationError(f"no spot trace for zone {zone!r}; zones: {', '.join(by_zone)}")
    order = [t.zone for t in traces]
    trace = by_zone[zone]
    if not 0 <= start_tick < len(trace.values):
        raise EmulationError(f"start_tick {start_tick} is outside the trace of {zone} (0..{len(trace.values) - 1})")
    tau, now, first = start_tick * trace.gap_seconds, 0.0, order.index(zone)
    segments: list[Segment] = []
    while len(segments) < limit:
        candidates = [order[(first + k) % len(order)] for k in range(len(order))]
        held = [(z, held_end(by_zone[z], tau)) for z in candidates]
        found = next(((z, end) for z, end in held if end is not None), None)
        if found is None:  # no zone has capacity now: wait for the first that does
            start = min(next_held(by_zone[z], tau) for z in candidates)
            now += (start - tau) / compress
            tau = start
            continue
        z, end = found
        drop = now + (end - tau) / compress
        if drop >= window_seconds or math.isinf(end):
            segments.append(Segment(z, by_zone[z].region, now, math.inf))
            return segments
        segments.append(Segment(z, by_zone[z].region, now, drop))
        now = drop + recovery_seconds
        tau = end + recovery_seconds * compress
        first = (order.index(z) + 1) % len(order)
    return segments


def load_spec(path: str | os.PathLike) -> dict[str, Any]:
    where = f"emulated cluster spec {path}"
    if not Path(path).is_file():
        raise EmulationError(f"{where}: no such file")
    try:
        spec = json.loads(Path(path).read_text())
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


# -- the seam ------------------------------------------------------------------------------------
def _term_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class _Job:
    def __init__(self, cluster: "EmulatedSkyJobs", job_id: int, name: str, task: Any, slot: str):
        self.cluster, self.job_id, self.name, self.task, self.slot = cluster, job_id, name, task, slot
        self.status, self.recovery_count, self.failure_reason = "PENDING", 0, None
        self.resources: dict[str, Any] | None = None
        self.cancel = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.launched = time.monotonic()
        self.task_id = f"sky-managed-{time.strftime('%Y-%m-%d-%H-%M-%S')}_{name}_{job_id}-0"
        job = cluster.spec["jobs"].get(slot)
        if job is None:
            raise EmulationError(f"emulated cluster spec has no schedule for {slot!r}; jobs: {', '.join(cluster.spec['jobs'])}")
        self.schedule = capacity_schedule(cluster.spec["_traces"], job["zone"], int(job["start_tick"]),
                                          float(cluster.spec["compress"]), float(cluster.spec["recovery_seconds"]),
                                          float(cluster.spec["preempt_window_seconds"]))
        self.log = Path(cluster.spec["logdir"]) / f"{name}-{job_id}.log"
        self.thread = threading.Thread(target=self._run, name=f"job-{name}", daemon=True)

    def record(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "job_name": self.name, "status": self.status,
                "recovery_count": self.recovery_count, "failure_reason": self.failure_reason,
                "resources": self.resources}

    def _pick(self, segment: Segment) -> dict[str, Any]:
        """The cheapest offer among the task's accelerators in the segment's region, as the optimizer would."""
        offers = []
        for r in self.task.resources:
            (name, count), = r.accelerators.items()
            try:
                instance, price = accelerator_price(f"{name}:{int(count)}", "aws", segment.region, bool(r.use_spot))
            except Exception:  # noqa: BLE001 - not offered in this region
                continue
            offers.append((price, instance, name, int(count), bool(r.use_spot)))
        if not offers:
            raise EmulationError(f"no catalog offer for {self.name} in {segment.region}")
        price, instance, name, count, spot = min(offers)
        return {"cloud": "AWS", "region": segment.region, "zone": segment.zone, "instance_type": instance,
                "accelerators": {name: count}, "use_spot": spot}

    def _env(self, segment: Segment) -> dict[str, str]:
        env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
        env["PATH"] = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"
        env.update({k: str(v) for k, v in self.task.envs.items()})
        env.update({k: v.get_secret_value() if hasattr(v, "get_secret_value") else str(v)
                    for k, v in self.task.secrets.items()})
        env.update(SKYPILOT_TASK_ID=self.task_id, SKYPILOT_NUM_NODES="1", SKYPILOT_NODE_RANK="0",
                   SKYPILOT_NODE_IPS="127.0.0.1", SKYPILOT_NUM_GPUS_PER_NODE="1",
                   SKYPILOT_CLUSTER_INFO=json.dumps({"cluster_name": f"{self.name}-{self.job_id}", "cloud": "AWS",
                                                     "region": segment.region, "zone": segment.zone}))
        return env

    def _start(self, segment: Segment) -> None:
        self.resources = self._pick(segment)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(["bash", "-c", self.task.run], cwd=self.task.workdir, env=self._env(segment),
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                         preexec_fn=_term_with_parent)
        self.status = "RUNNING"
        self.cluster.event("start", self, zone=segment.zone, pid=self.proc.pid)

    def _stop(self, why: str) -> str:
        """SIGTERM, wait the grace period, then kill -9: what a spot VM's end looks like to the process."""
        proc = self.proc
        assert proc is not None
        if proc.poll() is not None:
            return "exited"
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=float(self.cluster.spec["grace_seconds"]))
            how = "exited after SIGTERM"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            how = "killed (-9) after the grace period"
        self.cluster.event(why, self, how=how, rc=proc.returncode)
        return how

    def _run(self) -> None:
        restarts = 0
        max_restarts = int((self.task.resources and next(iter(self.task.resources)).job_recovery or {})
                           .get("max_restarts_on_errors", 0))
        for k, segment in enumerate(self.schedule):
            wait = segment.start - (time.monotonic() - self.launched)
            if wait > 0 and self.cancel.wait(wait):
                self.status = "CANCELLED"
                return
            self._start(segment)
            while True:
                remaining = segment.end - (time.monotonic() - self.launched)
                if self.cancel.is_set():
                    self._stop("cancel")
                    self.status = "CANCELLED"
                    return
                rc = self.proc.poll()
                if rc is not None:
                    if rc == 0:
                        self.status = "SUCCEEDED"
                        self.cluster.event("exit", self, rc=0)
                        return
                    restarts += 1
                    self.cluster.event("error-exit", self, rc=rc, restarts=restarts)
                    if restarts > max_restarts:
                        self.status, self.failure_reason = "FAILED", f"exit code {rc} after {restarts - 1} restarts"
                        return
                    self._start(segment)  # max_restarts_on_errors: again, on the same instance
                    continue
                if remaining <= 0:
                    break
                self.cancel.wait(min(remaining, 0.1))
            self.status = "RECOVERING"
            self._stop("preempt")
            self.recovery_count += 1
        self.status, self.failure_reason = "FAILED", "the emulated schedule ran out"


class EmulatedSkyJobs(SkyJobs):
    """``SkyJobs`` whose jobs are local processes preempted on a real trace's schedule."""

    def __init__(self, spec_path: str | None = None):
        self.spec = load_spec(spec_path or os.environ["EMULATED_CLUSTER"])
        Path(self.spec["logdir"]).mkdir(parents=True, exist_ok=True)
        self.jobs: list[_Job] = []
        self._lock = threading.Lock()

    def event(self, what: str, job: _Job, **extra: Any) -> None:
        line = {"event": what, "job": job.name, "job_id": job.job_id, "slot": job.slot, "t": time.time(),
                "recovery_count": job.recovery_count, **extra}
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

    def queue(self, name_match: str) -> list[dict[str, Any]]:
        with self._lock:
            return [j.record() for j in self.jobs if name_match in j.name]

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
