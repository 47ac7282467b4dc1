"""The SkyPilot task YAMLs, the project's checks on them, and placement by SkyPilot's own optimizer
over the shipped price-catalog fixture (offline: a private SkyPilot home, nothing fetched)."""

from __future__ import annotations

import csv
import filecmp
import os
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

os.environ.setdefault("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")

import sky  # noqa: E402

from flows.cli import app  # noqa: E402
from spotlight import catalog, cost  # noqa: E402
from spotlight.config.placement import MOUNT_MODES  # noqa: E402
from spotlight.queue_worker import PREEMPTED_EXIT_CODE  # noqa: E402
from spotlight.store import RunStore  # noqa: E402
from tasks.placement import (CATALOG_DIR, TaskYamlError, check_task_yaml,  # noqa: E402
                             cheapest_offers)

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "catalog"
YAMLS = sorted((REPO / "sky").glob("*.yaml"))


def test_there_is_a_yaml_per_worker_kind():
    assert {p.name for p in YAMLS} == {"controller.yaml", "explorer.yaml", "trainer.yaml"}


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
                   and r.job_recovery["recover_on_exit_codes"] == [PREEMPTED_EXIT_CODE] for r in task.resources)
        assert "SKYPILOT_TASK_ID" in task.run and {"SPOTLIGHT_SLOT", "IDLE_EXIT"} <= set(task.envs)
        kind = path.stem
        assert f'spotlight worker --kind {kind} --run "$RUN_URL" --idle-exit "$IDLE_EXIT"' in task.run
        if kind == "explorer":  # sequence parallelism: one member per GPU of the node, the group named by the task
            assert task.envs["SP_DEGREE"] == "1" and 'if [ "${SP_DEGREE:-1}" -gt 1 ]' in task.run
            assert ('python -m spotlight.sequence_parallel.launch --run "$RUN_URL" --group "$SKYPILOT_TASK_ID" \\\n'
                    '    --processes "$SKYPILOT_NUM_GPUS_PER_NODE" --device cuda --idle-exit "$IDLE_EXIT"') in task.run


def _bad(tmp_path: Path, old: str, new: str, src: str = "trainer.yaml") -> Path:
    text = (REPO / "sky" / src).read_text()
    assert old in text
    path = tmp_path / src
    path.write_text(text.replace(old, new))
    return path


@pytest.mark.parametrize("old, new, message", [
    ("accelerators: L4:1", "accelerators: L40X:1", "unknown accelerator 'L40X'"),
    ("strategy: EAGER_NEXT_REGION", "strategy: EAGER_NEXT_PLANET", "invalid job_recovery strategy 'EAGER_NEXT_PLANET'"),
    ("    max_restarts_on_errors: 3\n", "", "lacks max_restarts_on_errors"),
    ("recover_on_exit_codes: [143]", "recover_on_exit_codes: [1]", "recover_on_exit_codes lacks 143"),
    ('  RUN_URL: ""         # required: the s3:// run store (the launcher sets it)\n', "",
     "missing required env 'RUN_URL'"),
    ('  SPOTLIGHT_SLOT: ""', '  SPOTLIGHT_SLOTS: ""', "missing required env 'SPOTLIGHT_SLOT'"),
    ("  AWS_SECRET_ACCESS_KEY: null", "  AWS_SECRET_ACCESS_KEY: abc123", "has an inline value"),
    ("  use_spot: true\n", "  use_spot: true\n  cloud: aws\n", "pins a cloud"),
    ("workdir: .", "workdir: .\nnum_gpus: 8", "SkyPilot rejects it"),  # not a task key
])
def test_bad_yamls_are_rejected_with_a_clear_message(tmp_path, old, new, message):
    path = _bad(tmp_path, old, new)
    with pytest.raises(TaskYamlError) as err:
        check_task_yaml(path, FIXTURE)
    assert message in str(err.value) and str(path) in str(err.value)


def test_unknown_accelerator_is_one_skypilot_itself_accepts(tmp_path):
    """Why the project check exists: SkyPilot's parser takes any accelerator name and strategy."""
    path = _bad(tmp_path, "strategy: EAGER_NEXT_REGION", "strategy: NOPE", "explorer.yaml")
    path.write_text(path.read_text().replace("L4:1", "Z100:1"))
    sky.Task.from_yaml(str(path))  # no error from SkyPilot
    names = catalog.accelerator_names(FIXTURE / "v8")
    assert "z100" not in names and names["l4"] == "L4"


def test_mount_modes_are_skypilots():
    from sky.data.storage import StorageMode

    assert set(MOUNT_MODES) == {m.value for m in StorageMode}


def test_plan_catalog_is_the_fixture():
    diff = filecmp.dircmp(FIXTURE / "v8", CATALOG_DIR / "v8")
    assert not diff.diff_files and not diff.left_only and not diff.right_only
    for sub in diff.subdirs.values():
        assert not sub.diff_files and not sub.left_only and not sub.right_only


def _rows(cloud: str) -> list[dict[str, str]]:
    with open(FIXTURE / "v8" / cloud / "vms.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_optimizer_picks_the_cheapest_spot_offer_of_the_catalog():
    wanted = {"L4", "A10G", "A100", "H100"}  # explorer.yaml's any_of, one GPU each
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

    path = REPO / "sky" / "explorer.yaml"
    offers = cheapest_offers([path], FIXTURE)[str(path)]
    spot, on_demand = offers["spot"], offers["on_demand"]
    assert spot.use_spot and not on_demand.use_spot
    assert spot.price_per_hour == pytest.approx(hand_min[0], abs=1e-6)
    assert (spot.cloud.lower(), spot.instance_type) == (hand_min[1], hand_min[2])
    assert on_demand.price_per_hour > spot.price_per_hour


def test_plan_cli_prints_spot_vs_on_demand_and_uses_the_run_ledger(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    for it in range(2):
        cost.record(store, "update", it, 360, 0.0, "local", kind="trainer")  # 0.1 h of trainer time per iteration
    result = CliRunner().invoke(app, ["plan", "--run", store.url])
    assert result.exit_code == 0, result.output
    out = result.output
    assert f"trainer ({REPO}/sky/trainer.yaml): 0.100 h per iteration (ledger of {store.url})" in out
    assert f"explorer ({REPO}/sky/explorer.yaml): 0.250 h per iteration (default)" in out
    for block in out.split("\n\n")[0].split(" h per iteration")[1:]:
        spot = float(block.split("spot ")[1].split("$")[1].split("/h")[0])
        od = float(block.split("on-demand ")[1].split("$")[1].split("/h")[0])
        ratio = float(block.split("price ratio ")[1].split()[0])
        assert spot < od and ratio == pytest.approx(spot / od, abs=1e-3)
    assert "per iteration: spot $" in out and "on-demand $" in out


def test_plan_prices_the_placement_of_a_config():
    """What the launcher launches is the YAML with placement's resources: plan prices that too."""
    result = CliRunner().invoke(app, ["plan", "--config", str(REPO / "configs/tiny.yaml"),
                                      "--set", "placement.explorer.accelerators=[A10G:1]",
                                      "--set", "placement.trainer.use_spot=false"])
    assert result.exit_code == 0, result.output
    explorer = result.output.split("explorer (")[1].split("trainer (")[0]
    assert "(A10G:1)" in explorer.split("spot ")[1].split("\n")[0]


DOC_COMMAND = re.compile(r"^(sky (?:jobs )?launch) (?:-[nc] \S+ )?(sky/\w+\.yaml)((?:\s+--(?:env|secret) \S+)*)", re.M)


def test_sky_launch_and_sky_jobs_launch_both_take_the_yamls_as_documented():
    """Each `sky launch` / `sky jobs launch` command in docs/cloud.md, parsed the way SkyPilot's CLI parses
    its arguments (its own entrypoint-to-task function), gives a task with the envs and secrets set."""
    from sky.client.cli import command, flags

    doc = (REPO / "docs" / "cloud.md").read_text().replace("\\\n", " ")
    found = {(m.group(1), m.group(2)) for m in DOC_COMMAND.finditer(doc)}
    assert {("sky launch", "sky/trainer.yaml"), ("sky jobs launch", "sky/trainer.yaml"),
            ("sky jobs launch", "sky/explorer.yaml"), ("sky jobs launch", "sky/controller.yaml")} <= found, found
    env = {"AWS_ACCESS_KEY_ID": "AKIADOC", "AWS_SECRET_ACCESS_KEY": "doc-secret-0123456789",
           "SKYPILOT_API_SERVER_ENDPOINT": "http://127.0.0.1:46580", "AWS_SESSION_TOKEN": "doc-token",
           "PREFECT_API_URL": "https://prefect.example.com/api", "PREFECT_API_KEY": "pnu_doc"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for m in DOC_COMMAND.finditer(doc):
            args = m.group(3).split()
            envs = [flags._parse_env_var(v.replace("$RUN", "s3://b/runs/r")) for k, v in zip(args, args[1:]) if k == "--env"]
            secrets = [flags._parse_secret_var(v) for k, v in zip(args, args[1:]) if k == "--secret"]
            task = command._make_task_or_dag_from_entrypoint_with_overrides(
                (str(REPO / m.group(2)),), env=envs, secret=secrets)
            prefect_worker = task.envs.get("PREFECT_WORK_POOL")  # the controller as a Prefect worker, or one run
            assert prefect_worker or task.envs["RUN_URL"].startswith("s3://"), m.group(0)
            assert {k for k, _ in secrets} <= set(task.secrets), m.group(0)
            if m.group(2) != "sky/controller.yaml":
                assert all(r.job_recovery for r in task.resources)  # used by `sky jobs launch`; `sky launch` ignores it
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
