"""A real local Prefect server (``prefect server start``) for tests: free port, private home, own SQLite DB.

Tests talk to it the way users do: the ``prefect`` CLI and the Python client, both pointed at it by
``PREFECT_API_URL`` in the environment this helper builds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

PREFECT = str(Path(sys.executable).with_name("prefect"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrefectServer:
    url: str  # http://127.0.0.1:PORT (the UI)
    env: dict[str, str]  # an environment whose CLI/client calls go to this server
    log: Path

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def cli(self, *args: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess:
        """Run ``prefect ARGS`` against this server (``env``: more variables); a failure raises with its output."""
        proc = subprocess.run([PREFECT, *args], cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        if proc.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/api/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {url} not healthy after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@contextmanager
def prefect_server(home: Path, timeout: float = 120, api_only: bool = False) -> Iterator[PrefectServer]:
    """Start ``prefect server start`` on a free port with PREFECT_HOME and its SQLite DB under ``home``
    (``api_only``: no UI and no background services, what flows run directly against need)."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    (home / "tmp").mkdir(exist_ok=True)  # what the flow runs it starts leave (workers' logs) stays under home
    env.update(
        OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TMPDIR=str(home / "tmp"),
        PREFECT_HOME=str(home),
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_API_URL=f"{url}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_CLI_PROMPT="false",
    )
    log = home / "server.log"
    with open(log, "w") as out:
        lean = ["--no-ui", "--no-services"] if api_only else []
        proc = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), *lean],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait_healthy(url, proc, log, timeout)
        yield PrefectServer(url, env, log)
    finally:
        stop_process_group(proc, 20)


def stop_process_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a process started with ``start_new_session``, and its children; SIGKILL after ``timeout``."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class SessionServer:
    """One API-only server for a test process, started by the first run that needs it (a session of unit
    tests starts none) and stopped by ``close``. It lives here, not in conftest, because pytest may import
    conftest twice, and each import would hold a server of its own."""

    def __init__(self) -> None:
        self.home: Path | None = None  # set by the session fixture before any test runs
        self._stack = ExitStack()
        self._server: PrefectServer | None = None
        self._lock = threading.Lock()

    def api_url(self) -> str:
        with self._lock:
            if self._server is None:
                assert self.home is not None, "the session fixture `prefect_api` sets the server's home"
                self._server = self._stack.enter_context(prefect_server(self.home, api_only=True))
            return self._server.api_url

    def close(self) -> None:
        with self._lock:
            self._stack.close()
            self._server = None


SESSION_SERVER = SessionServer()
