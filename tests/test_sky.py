"""The SkyPilot task YAMLs, the project's checks on them, and placement by SkyPilot's own optimizer
over the shipped price-catalog fixture (offline: a private SkyPilot home, nothing fetched)."""

from __future__ import annotations

import csv
import filecmp
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

import sky  # noqa: E402

from flows.cli import app  # noqa: E402
from spotlight import cost  # noqa: E402
from spotlight.store import RunStore  # noqa: E402
from tasks.placement import (CATALOG_DIR, TaskYamlError, catalog_accelerators, check_task_yaml,  # noqa: E402
                             cheapest_offers)

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "catalog"
YAMLS = sorted((REPO / "sky").glob("*.yaml"))


def test_there_is_a_yaml_per_stage_kind():
    assert {p.name for p in YAMLS} == {"controller.yaml", "explore_worker.yaml", "update.yaml"}


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.name)
def test_every_yaml_parses_with_skypilot_and_passes_the_project_check(path):
    task = sky.Task.from_yaml(str(path))
    assert check_task_yaml(path, FIXTURE).name == task.name
    assert task.workdir == "." and "pip install -c constraints.txt -e ." in task.setup
    declared = yaml.safe_load(path.read_text())["secrets"]  # null = given at launch (--secret / the launcher)
    assert "RUN_URL" in task.envs and declared["AWS_ACCESS_KEY_ID"] is None and declared["AWS_SECRET_ACCESS_KEY"] is None
    if path.name == "controller.yaml":
        assert all(not r.use_spot and not r.accelerators for r in task.resources)
        assert "spotlight run" in task.run
    else:
        assert all(r.use_spot and r.cloud is None for r in task.resources) and len(task.resources) >= 4
        assert all(r.job_recovery["strategy"] == "EAGER_NEXT_REGION" and r.job_recovery["max_restarts_on_errors"] >= 1
                   for r in task.resources)
        assert "SKYPILOT_TASK_ID" in task.run
    if path.name == "update.yaml":
        assert "ITERATION" in task.envs and "SKYPILOT_NODE_IPS" in task.run and "accelerate launch" in task.run
        assert "spotlight\" stage update --run \"$RUN_URL\" --iteration \"$ITERATION\"" in task.run.replace(
            "$(command -v spotlight)", "spotlight")


def _bad(tmp_path: Path, old: str, new: str, src: str = "update.yaml") -> Path:
    text = (REPO / "sky" / src).read_text()
    assert old in text
    path = tmp_path / src
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, message", [
    ("accelerators: L4:1", "accelerators: L40X:1", "unknown accelerator 'L40X'"),
    ("strategy: EAGER_NEXT_REGION", "strategy: EAGER_NEXT_PLANET", "invalid job_recovery strategy 'EAGER_NEXT_PLANET'"),
    ("    max_restarts_on_errors: 3\n", "", "lacks max_restarts_on_errors"),
    ('  RUN_URL: ""                 # required: the s3:// run store\n', "", "missing required env 'RUN_URL'"),
    ('  ITERATION: ""', '  ITERATIONS: ""', "missing required env 'ITERATION'"),
    ("  AWS_SECRET_ACCESS_KEY: null", "  AWS_SECRET_ACCESS_KEY: abc123", "has an inline value"),
    ("  use_spot: true\n", "  use_spot: true\n  cloud: aws\n", "pins a cloud"),
    ("num_nodes: 1", "num_nodes: 1\nnum_gpus: 8", "SkyPilot rejects it"),  # not a task key
])
def test_bad_yamls_are_rejected_with_a_clear_message(tmp_path, old, new, message):
    path = _bad(tmp_path, old, new)
    with pytest.raises(TaskYamlError) as err:
        check_task_yaml(path, FIXTURE)
    assert message in str(err.value) and str(path) in str(err.value)


def test_unknown_accelerator_is_one_skypilot_itself_accepts(tmp_path):
    """Why the project check exists: SkyPilot's parser takes any accelerator name and strategy."""
    path = _bad(tmp_path, "strategy: EAGER_NEXT_REGION", "strategy: NOPE", "explore_worker.yaml")
    path.write_text(path.read_text().replace("L4:1", "Z100:1"))
    sky.Task.from_yaml(str(path))  # no error from SkyPilot
    assert "Z100" not in catalog_accelerators(FIXTURE) and "L4" in catalog_accelerators(FIXTURE)


def test_plan_catalog_is_the_fixture():
    diff = filecmp.dircmp(FIXTURE / "v8", CATALOG_DIR / "v8")
    assert not diff.diff_files and not diff.left_only and not diff.right_only
    for sub in diff.subdirs.values():
        assert not sub.diff_files and not sub.left_only and not sub.right_only


def _rows(cloud: str) -> list[dict[str, str]]:
    with open(FIXTURE / "v8" / cloud / "vms.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_optimizer_picks_the_cheapest_spot_offer_of_the_catalog():
    wanted = {"L4", "A10G", "A100", "H100"}  # explore_worker.yaml's any_of, one GPU each
    # By hand: whole-VM clouds (AWS, Azure) price GPU + host in one row.
    vm_rows = [(float(r["SpotPrice"]), cloud, r["InstanceType"])
               for cloud in ("aws", "azure") for r in _rows(cloud)
               if r["AcceleratorName"] in wanted and float(r["AcceleratorCount"]) == 1 and r["SpotPrice"]]
    hand_min = min(vm_rows)
    # GCP prices GPU and host apart: even the cheapest GPU row plus the cheapest host row of any
    # GPU family is dearer, so the minimum above is the catalog's minimum.
    gcp = _rows("gcp")
    gcp_gpu = min(float(r["SpotPrice"]) for r in gcp if r["AcceleratorName"] in wanted and not r["InstanceType"]
                  and float(r["AcceleratorCount"]) == 1 and r["SpotPrice"])
    gcp_host = min(float(r["SpotPrice"]) for r in gcp if r["InstanceType"] and r["SpotPrice"])
    assert gcp_gpu + gcp_host > hand_min[0]  # (Lambda has no spot market)

    path = REPO / "sky" / "explore_worker.yaml"
    offers = cheapest_offers([path], FIXTURE)[str(path)]
    spot, on_demand = offers["spot"], offers["on_demand"]
    assert spot.use_spot and not on_demand.use_spot
    assert spot.price_per_hour == pytest.approx(hand_min[0], abs=1e-6)
    assert (spot.cloud.lower(), spot.instance_type) == (hand_min[1], hand_min[2])
    assert on_demand.price_per_hour > spot.price_per_hour


def test_plan_cli_prints_spot_vs_on_demand_and_uses_the_run_ledger(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    for it in range(2):
        cost.record(store, "update", it, 360, 0.0, "local")  # 0.1 h per iteration
    result = CliRunner().invoke(app, ["plan", "--run", store.url])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"stage update ({REPO}/sky/update.yaml): 0.100 h per iteration (ledger of {store.url})" in out
    assert "stage explore" in out and "0.250 h per iteration (default)" in out
    for stage_block in out.split("stage ")[1:]:
        spot = float(stage_block.split("spot ")[1].split("$")[1].split("/h")[0])
        od = float(stage_block.split("on-demand ")[1].split("$")[1].split("/h")[0])
        ratio = float(stage_block.split("price ratio ")[1].split()[0])
        assert spot < od and ratio == pytest.approx(spot / od, abs=1e-3)
    assert "per iteration: spot $" in out and "on-demand $" in out
