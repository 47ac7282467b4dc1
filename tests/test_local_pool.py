"""The embedded default's worker pool (``tasks.workers.LocalPool``): what it leaves on the machine.

Every ``make run`` starts one; its workers' logs go to a temporary folder, which a run that ended well
removes (they piled up in /tmp, one folder per run), and which is kept, and named, when a worker failed
or the flow stopped on an error, because that is when someone reads them (a folder of empty logs goes too)."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from spotlight.config import load_config
from tasks.workers import LocalPool

REPO = Path(__file__).resolve().parents[1]


def pool_whose_worker_exited(tmp_path: Path, code: int, output: str) -> LocalPool:
    pool = LocalPool(load_config(REPO / "configs" / "tiny.yaml", run_url=f"file://{tmp_path}/run"))
    (pool.logs / "local-trainer-0.log").write_text(output)
    pool.procs["local-trainer-0"] = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
    pool.procs["local-trainer-0"].wait()
    return pool


@pytest.mark.parametrize("code, grace, output, kept", [(0, True, "worker output\n", False),
                                                       (143, True, "worker output\n", False),
                                                       (1, True, "worker output\n", True),
                                                       (0, False, "worker output\n", True),
                                                       (0, False, "", False), (1, True, "", False)])
def test_the_workers_logs_are_removed_after_a_run_that_ended_well_and_kept_otherwise(tmp_path, caplog, monkeypatch,
                                                                                   code, grace, output, kept):
    """Kept when a worker failed or the flow stopped on an error, unless no worker wrote a line to them."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # what is kept stays in this test's folder
    pool = pool_whose_worker_exited(tmp_path, code, output)
    assert pool.logs.parent == tmp_path
    with caplog.at_level(logging.WARNING, logger="tasks.workers"):
        pool.close(grace=grace)
    assert pool.logs.exists() == kept
    assert (f"the local workers' logs are kept in {pool.logs}" in caplog.text) == kept
    if kept:
        assert pool.log_tail("local-trainer-0") == "worker output"
