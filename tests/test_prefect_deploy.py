"""`prefect deploy` as users run it: a real local server, a process work pool, a worker, the UI in Chromium.

One server and one deployed run (plus its resumed re-run) are shared by the module's tests:
- the on-demand deployment runs the flow to Completed with its artifacts, from this clone;
- re-running it on the same run URL recomputes nothing (commit manifests keep their mtimes);
- the scheduled deployment carries its cron schedule;
- the UI (headless Debian Chromium) shows the run's name, its Completed state and its artifacts.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import Artifact, FlowRun
from prefect.settings import PREFECT_API_URL, temporary_settings

from prefect_server import PrefectServer, prefect_server
from spotlight import cost
from spotlight.store import RunStore
from tasks.artifacts import artifact_key, cost_so_far

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
def deployed(tmp_path_factory) -> Iterator[DeployedRun]:
    tmp = tmp_path_factory.mktemp("prefect")
    with prefect_server(tmp / "home") as server:
        server.cli("work-pool", "create", "spotlight", "--type", "process", cwd=tmp)
        server.cli("deploy", "--all", "--no-prompt", cwd=REPO)
        run_dir = tmp / "store" / "run"
        params = {"config_path": "configs/tiny.yaml", "run_url": f"file://{run_dir}", "overrides": OVERRIDES}
        first = run_deployment_once(server, params, tmp)
        mtimes = commit_mtimes(run_dir.parent)
        second = run_deployment_once(server, params, tmp)
        yield DeployedRun(server, run_dir, first, second, mtimes)


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
    report = render(f"{server.url}/artifacts/artifact/{artifacts[f'{RUN_NAME}-report'][-1].id}", "report",
                    tmp_path / "chromium-2")
    assert "Reward curve" in visible_text(report) and run.name in visible_text(report)
    assert len(re.findall(r'<img[^>]*src="data:image/png;base64,', report)) == 2  # the curve and samples shown
    table = visible_text(render(f"{server.url}/artifacts/artifact/{artifacts[f'{RUN_NAME}-iterations'][-1].id}",
                                "iterations", tmp_path / "chromium-3"))
    assert "train reward" in table and "zero-variance fraction" in table, table[:2000]


def test_cost_column_is_read_from_the_ledger(tmp_path) -> None:
    store = RunStore(f"file://{tmp_path}")
    assert cost_so_far(store) == "n/a"  # no ledger: no made-up zero
    cost.record(store, "update", 0, seconds=1800, price_per_hour=2.0, where="test")
    assert cost_so_far(store) == "$1.0000"
    assert artifact_key({"run": {"name": "My_Run 7"}}, "iterations") == "my-run-7-iterations"
