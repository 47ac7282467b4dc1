"""An emulated SkyPilot API server behind the ``SkyJobs`` seam: the managed jobs live in one process, and
every process that launches, lists or cancels them talks to it over HTTP, as SkyPilot's clients talk to
its API server. So a job outlives the process that launched it: the flow on an emulated controller
launches its workers here, a Prefect worker's crash hook (another process) cancels them here, and the
test reads the same records.

Behind it is ``tests/emulated_cluster.py``'s ``EmulatedSkyJobs`` (each job a local process of its YAML's
``run:`` script, with a managed job's environment; the task's workdir on PYTHONPATH stands in for its
``setup:``, ``pip install -e .``). A task travels as SkyPilot's own YAML
(``dag_utils.dump_dag_to_yaml_str``, secrets included, as the SDK sends it) and is parsed back with
SkyPilot's loader. Clients name it with ``SPOTLIGHT_SKY_JOBS=tests.jobs_api:RemoteSkyJobs`` and
``SPOTLIGHT_JOBS_API=http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tasks.launcher import ACTIVE, SkyJobs
from tests.emulated_cluster import EmulatedSkyJobs


class JobsApi(ThreadingHTTPServer):
    """The server: one ``EmulatedSkyJobs`` (``jobs``), on a free port of 127.0.0.1."""

    daemon_threads = True

    def __init__(self, spec_path: str):
        self.jobs = EmulatedSkyJobs(spec_path)
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def call(self, op: str, body: dict[str, Any]) -> Any:
        from sky.utils import dag_utils

        if op == "launch":
            [task] = dag_utils.load_dag_from_yaml_str(body["task"]).tasks
            task.update_envs({"PYTHONPATH": task.workdir})  # stands in for its setup (pip install -e .)
            return self.jobs.launch(task, body["name"])
        if op == "queue":
            return self.jobs.queue(body["name_match"])
        if op == "cancel":
            return self.jobs.cancel(body["name"])
        if op == "logs":
            return self.jobs.logs(body["job_id"], body["tail"])
        raise ValueError(f"no such operation: {op}")


class _Handler(BaseHTTPRequestHandler):
    server: JobsApi

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            status, answer = 200, {"result": self.server.call(self.path.strip("/"), body)}
        except Exception as e:  # noqa: BLE001 - the client raises it, as SkyPilot's SDK raises a server error
            status, answer = 500, {"error": f"{type(e).__name__}: {e}"}
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # requests are not the test's output
        pass


@contextmanager
def jobs_api(spec_path: str) -> Iterator[JobsApi]:
    """Serve the emulated jobs until the block ends, then cancel the jobs still active."""
    server = JobsApi(spec_path)
    thread = threading.Thread(target=server.serve_forever, name="jobs-api", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        for record in server.jobs.queue(""):
            if record["status"] in ACTIVE:
                server.jobs.cancel(record["job_name"])
        server.shutdown()
        server.server_close()


class RemoteSkyJobs(SkyJobs):
    """The client: SkyPilot's managed-jobs calls, sent to the emulated API server at ``SPOTLIGHT_JOBS_API``."""

    def __init__(self, url: str | None = None):
        self.url = url or os.environ["SPOTLIGHT_JOBS_API"]

    def _call(self, op: str, **body: Any) -> Any:
        request = urllib.request.Request(f"{self.url}/{op}", data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return json.loads(response.read())["result"]
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"emulated SkyPilot API server: {json.loads(e.read())['error']}") from None

    def launch(self, task: Any, name: str) -> int:
        from sky.utils import dag_utils

        return int(self._call("launch", task=dag_utils.dump_dag_to_yaml_str(dag_utils.convert_entrypoint_to_dag(task)),
                              name=name))

    def queue(self, name_match: str) -> list[dict[str, Any]]:
        return self._call("queue", name_match=name_match)

    def cancel(self, name: str) -> None:
        self._call("cancel", name=name)

    def logs(self, job_id: int, tail: int) -> str:
        return self._call("logs", job_id=job_id, tail=tail)
