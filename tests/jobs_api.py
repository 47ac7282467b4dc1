"""An emulated SkyPilot API server behind the ``SkyJobs`` seam: the managed jobs live in one process, and every
process that launches, lists or cancels them calls it over HTTP, as SkyPilot's clients call its API server.
So a job outlives the process that launched it: the flow on an emulated controller launches its workers
here, a Prefect worker's crash hook (another process) cancels them here, and the test reads the same records.

Behind it is ``tests/emulated_cluster.py``'s ``EmulatedSkyJobs`` (each job a local process of its YAML's
``run:`` script, with a managed job's environment; the task's workdir on PYTHONPATH stands in for its
``setup:``, ``pip install -e .``). A task travels as SkyPilot's own YAML (``dag_utils.dump_dag_to_yaml_str``,
secrets included, as the SDK sends it) and is parsed back with SkyPilot's loader; every other call of the
seam goes through as it is (arguments and answers pickled: both ends are this test suite). Clients name it
with ``SPOTLIGHT_SKY_JOBS=tests.jobs_api:RemoteSkyJobs`` and ``SPOTLIGHT_JOBS_API=http://127.0.0.1:PORT``.
"""

from __future__ import annotations

import inspect
import os
import pickle
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from tasks.launcher import SkyJobs
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

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "launch":
            from sky.utils import dag_utils

            task_yaml, name = args
            [task] = dag_utils.load_dag_from_yaml_str(task_yaml).tasks
            task.update_envs({"PYTHONPATH": task.workdir})  # stands in for its setup (pip install -e .)
            return self.jobs.launch(task, name)
        if method.startswith("_") or not callable(getattr(SkyJobs, method, None)):
            raise ValueError(f"{method} is not a call of the SkyJobs seam")
        return getattr(self.jobs, method)(*args)


class _Handler(BaseHTTPRequestHandler):
    server: JobsApi

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        args = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
        try:
            status, data = 200, pickle.dumps(self.server.call(self.path.strip("/"), args))
        except Exception as e:  # noqa: BLE001 - the client raises it, as SkyPilot's SDK raises a server error
            status, data = 500, f"{type(e).__name__}: {e}".encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # requests are not the test's output
        pass


@contextmanager
def jobs_api(spec_path: str) -> Iterator[JobsApi]:
    """Serve the emulated jobs until the block ends, then cancel the jobs still going."""
    server = JobsApi(spec_path)
    thread = threading.Thread(target=server.serve_forever, name="jobs-api", daemon=True)
    thread.start()
    try:
        yield server
    finally:
        for job in list(server.jobs.jobs):
            if job.thread.is_alive():
                server.jobs.cancel(job.name)
        server.shutdown()
        server.server_close()


class RemoteSkyJobs(SkyJobs):
    """The client: each call of the seam, sent to the emulated API server at ``SPOTLIGHT_JOBS_API``."""

    def __init__(self, url: str | None = None):
        self.url = url or os.environ["SPOTLIGHT_JOBS_API"]

    def _call(self, method: str, *args: Any) -> Any:
        request = urllib.request.Request(f"{self.url}/{method}", data=pickle.dumps(args), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return pickle.loads(response.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"emulated SkyPilot API server: {e.read().decode()}") from None

    def launch(self, task: Any, name: str) -> int:
        from sky.utils import dag_utils

        return self._call("launch", dag_utils.dump_dag_to_yaml_str(dag_utils.convert_entrypoint_to_dag(task)), name)


def _remote(method: str) -> Callable[..., Any]:
    def call(self: RemoteSkyJobs, *args: Any) -> Any:
        return self._call(method, *args)
    call.__name__ = method
    return call


for _method, _ in inspect.getmembers(SkyJobs, inspect.isfunction):  # the seam's other calls, whatever they are
    if not _method.startswith("_") and _method != "launch":
        setattr(RemoteSkyJobs, _method, _remote(_method))


def status(record: dict[str, Any]) -> str:
    """A job record's status as its name (SkyPilot's ManagedJobStatus, or its value)."""
    return str(getattr(record["status"], "value", record["status"]))
