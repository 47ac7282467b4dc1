"""`spotlight simulate`: the replay of real spot traces, catalog prices, curves from run stores, and bad input."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from spotlight import simulate as sim
from spotlight.store import RunStore, json_bytes
from tests.conftest import SPOTLIGHT, cli_env, run_cli

CATALOG_AWS = sim.CATALOG_DIR / "aws" / "vms.csv"


def write_run(root: Path, name: str, rewards: list[float], trainer_seconds: float,
              explore_seconds: float | None = None) -> str:
    """A run store with what a run writes: evaluations, timeline, and (when exploring) explore stats and
    the exploration queue's items (two prompts of two seed batches each)."""
    store = RunStore(f"file://{root / name}")
    for t, reward in enumerate(rewards):
        store.commit(f"evaluations/{t:04d}", {"metrics.json": json_bytes({"iteration": t, "eval_reward": reward})},
                     {"iteration": t})
    for t in range(len(rewards) - 1):
        store.put_json(f"timeline/{t:04d}.json", {"iteration": t, "critical_path_seconds": trainer_seconds + 0.5,
                                                  "update_seconds": trainer_seconds - 0.25, "explore_wait_seconds": 0.5})
        if explore_seconds is not None:
            store.commit(f"iterations/{t:04d}/explore", {"explored.json": json_bytes({}), "stats.json": json_bytes(
                {"rollout_seconds": explore_seconds, "wall_seconds": explore_seconds / 2, "candidates": 64})})
            items = [{"id": p, "units": [f"{p}-b0", f"{p}-b1"]} for p in ("p000", "p001")]
            store.commit(f"queues/explore-{t:04d}/items", {"items.json": json_bytes(items)})
    return store.url


def synthetic_trace(tmp_path: Path, values: list[int], gap: int = 10, zone: str = "us-test-1a") -> sim.Trace:
    path = tmp_path / f"{zone}_gpu_1.json"
    path.write_text(json.dumps({"metadata": {"gap_seconds": gap}, "data": values}))
    return sim.load_trace(path)


# held [0, 50) s, no capacity [50, 70) s, held after: one preemption at 50 s
PREEMPTED_AT_50 = [1] * 5 + [0] * 2 + [1] * 100


def test_shipped_traces_and_catalog_are_read_as_they_are():
    traces = sim.load_traces()
    assert [t.zone for t in traces] == ["us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"]
    assert {t.gap_seconds for t in traces} == {32} and {len(t.values) for t in traces} == {19961}
    assert [t.preemptions for t in traces] == [41, 60, 44, 57]  # the 1 -> 0 drops (sky/traces/README.md)
    assert {t.region for t in traces} == {"us-east-1", "us-west-2"}
    price = sim.catalog_price("A100:8", "aws", "us-east-1")
    # the catalog's p4d.24xlarge rows in us-east-1: Price 21.957642, SpotPrice 2.4655, 8.1915, 8.1203, 7.8799
    assert (price.instance_type, price.on_demand, price.spot_zones) == ("p4d.24xlarge", 21.957642, 4)
    assert price.spot == pytest.approx((7.8799 + 8.1203) / 2)
    assert (price.spot_low, price.spot_high) == (2.4655, 8.1915)
    assert "p4d.24xlarge" in CATALOG_AWS.read_text()


def test_replay_by_hand_sync(tmp_path):
    """Cold start 20 s, updates of 30 s: 20-50 first update (ends as capacity goes), capacity back at 70,
    recovery to 90, second update 90-120. Held 0-50 and 70-120."""
    trace = synthetic_trace(tmp_path, PREEMPTED_AT_50)
    spot = sim.ReplayWorker(trace.held_from(0), 20, 20)
    assert sim.sync_run(spot, 2, 30) == 120
    assert spot.held_seconds(120) == 100 and spot.preemptions(120) == 1
    on_demand = sim.ReplayWorker.on_demand(20)
    assert sim.sync_run(on_demand, 2, 30) == 80 and on_demand.held_seconds(80) == 80


def test_replay_by_hand_preemption_loses_the_unit_in_flight(tmp_path):
    """A trainer whose update is cut at 50 s redoes it whole after the recovery."""
    trace = synthetic_trace(tmp_path, PREEMPTED_AT_50)
    spot = sim.ReplayWorker(trace.held_from(0), 20, 20)
    # 20-45 done, 45-70 cut at 50 (5 s lost), capacity at 70, booted at 90, 90-115
    assert sim.sync_run(spot, 2, 25) == 115
    assert spot.held_seconds(115) == 50 + 45


def test_replay_by_hand_spotlight(tmp_path):
    """explore(0): trainer and explorer take a 20 s unit each at 20 s, done at 40. update(0) 40-70 on the
    on-demand trainer; explore(1): unit A 40-60 is cut at 50, the explorer is back at 90 (capacity at 70 +
    20 s recovery): A 90-110, B 110-130. update(1) 130-160. Dollars: trainer 160 s on demand, explorer
    held 0-50 and 70-160 on spot."""
    trace = synthetic_trace(tmp_path, PREEMPTED_AT_50)
    trainer, explorer = sim.ReplayWorker.on_demand(20), sim.ReplayWorker(trace.held_from(0), 20, 20)
    assert sim.spotlight_run(trainer, [explorer], 2, 30, [20, 20], stall=120) == 160
    assert (explorer.held_seconds(160), explorer.preemptions(160)) == (140, 1)
    # spot trainer: update(0) cut at 50, redone 90-120; iteration 1 still waits for the exploration (130)
    trainer, explorer = sim.ReplayWorker(trace.held_from(0), 20, 20), sim.ReplayWorker(trace.held_from(0), 20, 20)
    assert sim.spotlight_run(trainer, [explorer], 2, 30, [20, 20], stall=120) == 160
    assert trainer.held_seconds(160) == explorer.held_seconds(160) == 140


def test_replay_by_hand_trainer_joins_a_stalled_exploration(tmp_path):
    """As above, but the trainer joins once its update is over and nothing progressed for 0 s: at 70 it
    takes B (70-90) while the explorer is down; the explorer redoes A 90-110. update(1) 110-140."""
    trace = synthetic_trace(tmp_path, PREEMPTED_AT_50)
    trainer, explorer = sim.ReplayWorker.on_demand(20), sim.ReplayWorker(trace.held_from(0), 20, 20)
    assert sim.spotlight_run(trainer, [explorer], 2, 30, [20, 20], stall=0) == 140
    assert sim.stalled_from(40, [110, 130], 70, 0) == 70 and sim.stalled_from(40, [110, 130], 70, 120) is None
    assert sim.stalled_from(40, [110, 130], 70, 30) == 70 and sim.stalled_from(40, [110, 130], 70, 60) == 100


def test_forecast_dollars_and_ratios_by_hand(tmp_path):
    """The whole forecast on the synthetic trace, priced with the catalog. All-spot takes 40 s longer than
    on-demand (20 s without capacity, 20 s recovery) and pays the spot price for the 100 s it held an
    instance. Spotlight needs one iteration: explore(0) 20-40 s, update(0) 40-70 s; its explorer held
    capacity 0-50 s."""
    trace = synthetic_trace(tmp_path, PREEMPTED_AT_50, zone="us-east-1z")
    curves = {"none": sim.Curve("none", ((0, 0.5), (1, 0.7), (2, 0.9)), ("a",)),
              "spotlight": sim.Curve("spotlight", ((0, 0.5), (1, 0.95)), ("b",))}
    times = sim.StageTimes({"none": 30.0, "spotlight": 30.0}, 40.0, 2, {})
    scenario = sim.Scenario(target=0.9, explorers=1, cold_start_seconds=20, recovery_seconds=20, offsets=1)
    fc = sim.forecast(scenario, curves, times, [trace], region="us-east-1")
    price = sim.catalog_price("A100:8", "aws", "us-east-1")
    on_demand, spot = fc.schedule("on-demand sync"), fc.schedule("all-spot sync")
    assert on_demand.iterations == spot.iterations == 2
    assert on_demand.outcomes["us-east-1z"][0] == sim.ReplayOutcome(80, 80 / 3600 * price.on_demand, 0)
    assert spot.outcomes["us-east-1z"][0] == sim.ReplayOutcome(120, 100 / 3600 * price.spot, 1)
    light = fc.schedule("spotlight, on-demand trainer")
    assert light.iterations == 1  # one update after explore(0): 20-40 explore(0), 40-70 update(0)
    assert light.outcomes["us-east-1z"][0] == sim.ReplayOutcome(
        70, 70 / 3600 * price.on_demand + 50 / 3600 * price.spot, 1)


def test_forecast_on_shipped_traces_is_deterministic_and_spot_is_cheaper():
    curves = {"none": sim.Curve("none", tuple(enumerate([0.85, 0.9, 0.93, 0.95, 0.96, 0.97])), ("a",)),
              "spotlight": sim.Curve("spotlight", tuple(enumerate([0.85, 0.93, 0.97, 0.98])), ("b",))}
    times = sim.StageTimes({"none": 90.0, "spotlight": 95.0}, 240.0, 16, {})
    scenario = sim.Scenario(target=0.97, explorers=4, offsets=8)
    first = sim.forecast(scenario, curves, times, sim.load_traces())
    again = sim.forecast(scenario, curves, times, sim.load_traces())
    assert first.schedules == again.schedules
    base = first.schedule("on-demand sync").outcomes["us-west-2b"][0]
    assert base.seconds == 300 + 5 * 90 and base.preemptions == 0
    for name in ("all-spot sync", "spotlight, on-demand trainer", "spotlight, spot trainer"):
        outs = first.schedule(name).outcomes
        assert set(outs) == {"us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"}
        assert all(len(o) == 8 for o in outs.values())
    spot = first.schedule("all-spot sync").outcomes["us-west-2b"]
    assert all(o.seconds >= base.seconds for o in spot)  # never faster than no preemptions at all
    # a run that starts with capacity and keeps it: the same time, the spot price instead
    calm = [o for o in spot if o.seconds == base.seconds]
    assert calm and all(o.dollars == pytest.approx(base.dollars * 8.3527 / 21.957642, rel=1e-4) for o in calm)
    assert first.schedule("spotlight, on-demand trainer").iterations == 2


def test_curves_and_stage_times_from_run_stores(tmp_path):
    write_run(tmp_path, "none-s0", [0.80, 0.85, 0.90, 0.92], trainer_seconds=2.0)
    write_run(tmp_path, "none-s1", [0.80, 0.87, 0.92, 0.94], trainer_seconds=4.0)
    write_run(tmp_path, "spotlight-s0", [0.80, 0.91, 0.95, 0.97], trainer_seconds=3.0, explore_seconds=6.0)
    write_run(tmp_path, "sync-s0", [0.8, 0.99], trainer_seconds=1.0, explore_seconds=1.0)  # not a schedule's mode
    records = sim.runs_in(tmp_path)
    curves = sim.curves_of(records)
    assert [t for t, _ in curves["none"].rewards] == [0, 1, 2, 3]
    assert [r for _, r in curves["none"].rewards] == pytest.approx([0.80, 0.86, 0.91, 0.93])
    assert curves["none"].iterations_to(0.91) == 2 and curves["none"].iterations_to(0.95) is None
    assert curves["spotlight"].iterations_to(0.95) == 2
    times = sim.stage_times(records)
    assert times.trainer_seconds == {"none": 3.0, "spotlight": 3.0}
    assert (times.explore_seconds, times.explore_units) == (6.0, 4)
    given = sim.stage_times(records, update_seconds=90, explore_seconds=60, explore_units=16)
    assert (given.trainer_seconds, given.explore_seconds, given.explore_units) == ({"none": 90, "spotlight": 90}, 60, 16)


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": []}), "non-empty list"),
    (json.dumps({"metadata": {"gap_seconds": 32}}), "non-empty list"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [1, 1, "0", 1]}), "data[2] = '0'"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [1, 0.5]}), "data[1] = 0.5"),
    (json.dumps({"metadata": {}, "data": [1, 0]}), "gap_seconds"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [0, 0]}), "never held"),
])
def test_malformed_trace_is_refused_naming_it(tmp_path, content, problem):
    path = tmp_path / "us-east-1a_v100_1.json"
    path.write_text(content)
    with pytest.raises(sim.SimulationError, match=re.escape(problem)) as err:
        sim.load_trace(path)
    assert str(path) in str(err.value)


def test_bad_inputs_are_refused_naming_them(tmp_path):
    with pytest.raises(sim.SimulationError, match="us-east-1a_v100_1.json: no such file"):
        sim.load_trace(tmp_path / "us-east-1a_v100_1.json")
    with pytest.raises(sim.SimulationError, match="no spot trace for zone.*eu-north-9z.*us-east-1c"):
        sim.load_traces(zones=["eu-north-9z"])
    with pytest.raises(sim.SimulationError, match="no such folder"):
        sim.load_traces(tmp_path / "nope")
    with pytest.raises(sim.SimulationError, match="'Z900' is not in SkyPilot's catalog"):
        sim.catalog_price("Z900:8", "aws", "us-east-1")
    with pytest.raises(sim.SimulationError, match="no on-demand row for H100:3 in region 'us-east-1'"):
        sim.catalog_price("H100:3", "aws", "us-east-1")
    with pytest.raises(sim.SimulationError, match="p5.4xlarge .* has no spot price in us-east-1"):
        sim.catalog_price("H100:1", "aws", "us-east-1")
    with pytest.raises(sim.SimulationError, match="needs at least one explorer"):
        sim.Scenario(target=0.9, explorers=0)
    curves = {"none": sim.Curve("none", ((0, 0.95), (1, 0.97)), ("a",)),
              "spotlight": sim.Curve("spotlight", ((0, 0.95), (1, 0.99)), ("b",))}
    times = sim.StageTimes({"none": 30.0, "spotlight": 30.0}, 40.0, 2, {})
    with pytest.raises(sim.SimulationError, match="already met by the base policy"):
        sim.forecast(sim.Scenario(target=0.9), curves, times, sim.load_traces())
    trace = synthetic_trace(tmp_path, [1, 1, 0, 1], zone="us-east-1z")
    with pytest.raises(sim.SimulationError, match="shorter than one unit of work"):
        sim.forecast(sim.Scenario(target=0.96), curves, times, [trace])
    with pytest.raises(sim.SimulationError, match="no committed evaluations"):
        sim.read_run("none", f"file://{tmp_path}/empty")


def test_a_target_no_curve_reaches_is_reported_not_invented(tmp_path):
    curves = {"none": sim.Curve("none", ((0, 0.8), (1, 0.9), (2, 0.93)), ("a",)),
              "spotlight": sim.Curve("spotlight", ((0, 0.8), (1, 0.96)), ("b",))}
    times = sim.StageTimes({"none": 60.0, "spotlight": 60.0}, 60.0, 4, {})
    fc = sim.forecast(sim.Scenario(target=0.95, offsets=2), curves, times, sim.load_traces(zones=["us-west-2b"]))
    assert fc.schedule("on-demand sync").iterations is None and fc.schedule("on-demand sync").outcomes == {}
    assert fc.schedule("spotlight, spot trainer").iterations == 1
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(sim.summary_table(fc))
    text = console.export_text()
    assert "not reached (best 0.930, theta_2)" in text and "n/a" in text
    none_reach = sim.forecast(sim.Scenario(target=0.99, offsets=2), curves, times, sim.load_traces(zones=["us-west-2b"]))
    assert all(s.iterations is None and not s.outcomes for s in none_reach.schedules)
    plot = sim.write_plot(none_reach, tmp_path / "none.png")
    assert plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_end_to_end_prints_the_table_and_writes_the_plot(tmp_path):
    curves = tmp_path / "bench"
    write_run(curves, "none-s0", [0.80, 0.85, 0.90, 0.92, 0.95], trainer_seconds=2.0)
    write_run(curves, "spotlight-s0", [0.80, 0.91, 0.95, 0.97, 0.98], trainer_seconds=2.0, explore_seconds=6.0)
    plot = tmp_path / "out" / "sim.png"
    proc = subprocess.run([SPOTLIGHT, "simulate", "--curves", str(curves), "--target", "0.95", "--update-seconds",
                           "90", "--explore-seconds", "240", "--offsets", "4", "--zones", "us-west-2b,us-east-1f",
                           "--plot", str(plot)], cwd=tmp_path, env={**cli_env(tmp_path), "COLUMNS": "200"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    for text in ("on-demand sync", "all-spot sync", "spotlight, on-demand trainer", "spotlight, spot trainer",
                 "1.00x", "us-west-2b", "us-east-1f", "p4d.24xlarge", "cold start 300 s", f"plot: {plot}"):
        assert text in out, text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


def test_cli_bad_input_is_one_red_line_and_exit_2(tmp_path):
    bad = tmp_path / "traces"
    bad.mkdir()
    (bad / "us-east-1a_v100_1.json").write_text('{"metadata": {"gap_seconds": 32}, "data": [1, "x"]}')
    write_run(tmp_path / "bench", "none-s0", [0.8, 0.9], trainer_seconds=2.0)
    write_run(tmp_path / "bench", "spotlight-s0", [0.8, 0.95], trainer_seconds=2.0, explore_seconds=4.0)
    proc = run_cli([SPOTLIGHT, "simulate", "--curves", str(tmp_path / "bench"), "--target", "0.9",
                    "--traces", str(bad), "--plot", str(tmp_path / "p.png")], tmp_path, timeout=300)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "us-east-1a_v100_1.json: data[1] = 'x'" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.png").exists()
