"""`spotlight simulate` (spotlight/forecast/): the replay, the flow's join rule, the schedules, prices from the
placement and the catalog, the horizon, curves from run stores, the width lever, and bad input.

Hand-computed cases run on traces built with ``Trace.from_values`` (no files). The held capacity most of
them replay: held [0, 50) s, none [50, 70) s, held after: one preemption at 50 s.
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from spotlight.config import load_config
from spotlight.forecast import boot, curves as fcurves, estimate, records, replay, report, schedules, work
from spotlight.forecast.errors import ForecastError
from spotlight.forecast.prices import Offer, controller_offer, worker_offer
from spotlight.forecast.replay import Exploration, ReplayWorker
from spotlight.forecast.requests import BEFORE, CURRENT, Polling
from spotlight.forecast.traces import Trace, load_trace, load_traces
from spotlight.forecast.widths import cheapest, real_width, width_options
from spotlight.store import RunStore, json_bytes
from tests.conftest import SPOTLIGHT, cli_env, run_cli

REPO = Path(__file__).resolve().parents[1]
SD35M = load_config(REPO / "configs/sd35m-pickscore.yaml")
PREEMPTED_AT_50 = [1] * 5 + [0] * 2 + [1] * 100  # 10 s ticks


def spot(boot_seconds: float = 20.0) -> ReplayWorker:
    return ReplayWorker(Trace.from_values(PREEMPTED_AT_50).held_from(0), boot_seconds)


def stages(update: float, items: list[list[float]], explorers: int, evaluate: float = 0.0, every: int = 0,
           trainer_factor: float = 1.0) -> schedules.StageSeconds:
    factors = [1.0] * explorers + [trainer_factor]
    return schedules.StageSeconds(update, evaluate, every, Exploration(items, factors), Exploration(items, factors))


# -- the replay ---------------------------------------------------------------------------------------
def test_shipped_traces_are_read_as_they_are():
    traces = load_traces()
    assert [t.zone for t in traces] == ["us-east-1c", "us-east-1f", "us-west-2b", "us-west-2c"]
    assert {t.gap_seconds for t in traces} == {32} and {len(t.values) for t in traces} == {19961}
    assert [t.preemptions for t in traces] == [41, 60, 44, 57]  # the 1 -> 0 drops (sky/traces/README.md)
    assert {t.region for t in traces} == {"us-east-1", "us-west-2"}


def test_a_stage_preempted_is_redone_whole_after_the_recovery():
    """Boot 20 s; updates of 25 s: 20-45 done, 45-70 cut at 50 (5 s lost, busy), capacity at 70, booted at
    90, 90-115. Held 0-50 and 70-115."""
    worker = spot()
    clock = replay.run_stage(worker, 0.0, 25)
    assert (clock, replay.run_stage(worker, clock, 25)) == (45, 115)
    assert (worker.held_seconds(115), worker.preemptions(115), worker.busy) == (95, 1, 25 + 5 + 25)
    on_demand = ReplayWorker.on_demand(20)
    assert replay.run_stage(on_demand, replay.run_stage(on_demand, 0, 30), 30) == 80


def test_an_exploration_queue_by_hand():
    """Two items of two 10 s units; the spot worker alone. 20-30 unit a0, 30-40 a1 (item a done), 40-50 b0,
    b1 starts at 50 and is cut: b is free again at 50 with one unit left; back at 90: b1 90-100."""
    worker = spot()
    assert replay.run_items([worker], 0.0, [[10, 10], [10, 10]]) == 100
    assert worker.busy == 20 + 10 + 10  # item a, b0 and the lost part of b1, b1 again
    # an on-demand worker beside it takes item b at 20 (lowest index first among free items: a, then b)
    worker, helper = spot(), ReplayWorker.on_demand(20)
    assert replay.run_items([worker, helper], 0.0, [[10, 10], [10, 10]]) == 40
    # items held by others are theirs: a free worker waits, it does not split an item
    assert replay.run_items([ReplayWorker.on_demand(0), ReplayWorker.on_demand(0)], 0.0, [[10, 10, 10]]) == 30


def test_the_exploration_cache_equals_the_unit_by_unit_replay():
    items = [[7.0, 7.0, 3.0], [7.0, 7.0], [5.0]]
    for start in (0.0, 13.0, 33.0, 45.0, 60.0, 95.0):
        cached = Exploration(items, [1.0, 1.0])
        first = cached.finish([spot(), ReplayWorker.on_demand(20)], 0.0)  # fills the cache
        a, b = [spot(), ReplayWorker.on_demand(20)], [spot(), ReplayWorker.on_demand(20)]
        assert cached.finish(a, start, {1: start + 4}) == replay.run_items(b, start, items, {1: start + 4}, [1.0, 1.0])
        assert [w.busy for w in a] == [w.busy for w in b] and first > 0


# -- the schedules ------------------------------------------------------------------------------------------
def test_join_rule_the_trainer_joins_the_moment_its_update_commits():
    """explore(0): trainer and explorer each take a 20 s item at 20 s, done at 40. update(0) 40-70 on the
    on-demand trainer; explore(1) beside it: the explorer takes item 0 at 40, is preempted at 50 (item 0
    free again at 50), back at 90. The trainer may not explore during its update, although both items are
    free from 50; it joins at 70, when update(0) commits: item 1 (free since 40) 70-90; the explorer item 0
    90-110. update(1) 110-140. (The former rule, join after 120 s without progress, gave 160.)"""
    trainer, explorer = ReplayWorker.on_demand(20), spot()
    line = schedules.Spotlight("s", "spotlight", False, "spot").run(trainer, [explorer], 2, stages(30, [[20], [20]], 1))
    assert (line.end, line.explorations, line.exploring_seconds) == (140, 2, (40 - 0) + (110 - 40))
    assert (trainer.busy, explorer.busy) == (20 + 30 + 20 + 30, 20 + 10 + 20)
    assert (explorer.held_seconds(140), explorer.preemptions(140)) == (120, 1)


def test_join_rule_the_trainer_helps_explorers_that_are_still_working():
    """All on demand, boots 0, three 20 s items. explore(0): explorer 0-20, trainer 0-20, explorer 20-40.
    update(0) 40-70; explore(1): explorer 40-60, 60-80, the trainer joins at 70 and takes the third 70-90.
    update(1) 90-120: theta_2 at 120 (the explorer alone would have ended explore(1) at 100: 130)."""
    trainer, explorer = ReplayWorker.on_demand(0), ReplayWorker.on_demand(0)
    line = schedules.Spotlight("s", "spotlight", False, "spot").run(trainer, [explorer], 2,
                                                                  stages(30, [[20], [20], [20]], 1))
    assert line.end == 120


def test_sync_exploration_puts_the_exploration_on_the_critical_path():
    """On-demand trainer and explorer, boots 10 s, an evaluation of 5 s after every update but the last.
    evaluate(0) 10-15 on the trainer. explore(0) at 15: explorer item 0 and trainer item 1 15-35, the
    explorer item 2 35-55. update(0) 55-85, evaluate 85-90. explore(1) 90-110 (items 0, 1), 110-130
    (item 2). update(1) 130-160: theta_2 at 160."""
    trainer, explorer = ReplayWorker.on_demand(10), ReplayWorker.on_demand(10)
    line = schedules.SyncExploration("x", "sync", False, "on-demand").run(
        trainer, [explorer], 2, stages(30, [[20], [20], [20]], 1, evaluate=5, every=1))
    assert (line.end, line.exploring_seconds, line.explorations, line.stages) == (160, 40 + 40, 2, 1 + 2 + 1)


def test_sync_baseline_runs_updates_and_due_evaluations_back_to_back():
    trainer = ReplayWorker.on_demand(10)
    line = schedules.Sync("s", "none", False, None).run(trainer, [], 4, stages(30, [[1]], 0, evaluate=5, every=2))
    # evaluate(0) 10-15; updates 15-45, 45-75, evaluate(2) 75-80, 80-110, 110-140 (theta_4: not evaluated here)
    assert (line.end, line.stages) == (140, 1 + 4 + 1)


def test_a_whole_forecast_billed_by_hand():
    """Spotlight with an on-demand trainer at $3.60/h and one spot explorer at $1.80/h, as in the join-rule
    case (theta_2 at 140 s), a controller at $0.36/h, S3 requests at one GET per waiting process per second."""
    trace = Trace.from_values(PREEMPTED_AT_50, zone="us-east-1z")
    offer = Offer("trainer", "X:1", "x", False, 3.6, "us-east-1", "hand")
    setup = estimate.Setup(offer, replace(offer, kind="explorer", use_spot=True, usd_per_hour=1.8), 1,
                           replace(offer, kind="controller", usd_per_hour=0.36), stages(30, [[20], [20]], 1), 2, 2, 1.0)
    sc = estimate.Scenario(0.9, fcurves.Horizon(2, 2), 30.0, boot.Boot(20, 1.0, boot.WeightBytes(0, "none")),
                           Polling("1 GET/s", (0.0, 1.0), (0.0, 0.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)))
    out = estimate.simulate(schedules.Spotlight("s", "spotlight", False, "placement"), setup, trace, 0,
                            fcurves.ToTarget(0, 2, True), sc)
    assert (out.seconds, out.preemptions) == (140, 1)
    bill = dict(out.usd)
    assert bill["trainer"] == pytest.approx(140 / 3600 * 3.6) and bill["explorers"] == pytest.approx(120 / 3600 * 1.8)
    assert bill["controller"] == pytest.approx(140 / 3600 * 0.36)
    # work: 2 stages (updates; no evaluation) x 10, 2 explorations x 10, 4 items x (2/2 + 3), 4 units: 60 PUT-class;
    # waiting, 1 GET/s: controller 140 s, trainer 140 - 100 busy, explorer 120 held - 50 busy
    puts, gets = 2 * 10 + 2 * 10 + 4 * 4 + 4, 2 * 5 + 2 * 10 + 4 * 1 + 4 + 140 + 40 + 70
    assert bill["s3"] == pytest.approx(puts * 0.005 / 1000 + gets * 0.0004 / 1000)
    # the code before issue 18, 20 items open: queue.status() (41 LIST + 20 GET) twice a second, + the join key's
    # HEAD, + the update's commit marker, and the pool check about once a second: 82 LIST/s and 45 GET/s, $1.54/h
    assert BEFORE.controller_exploring(20) == (82, 45)
    # now: one request a look every 4 s, whatever the queue's size, and the HEAD of the key that frees the
    # trainers every 15 s (a net: the controller saw the update commit)
    assert CURRENT.controller_exploring(20) == CURRENT.controller_exploring(2000) == (0.0, pytest.approx(0.25 + 1 / 15))


# -- prices, work and boots at the real config ------------------------------------------------------------
def test_explorers_come_from_the_placement_priced_from_the_catalog():
    """sd35m: explorers L40S:1 / A100:1 / A100-80GB:1 / H100:1, spot, 2 of them. On AWS only L40S:1 has a
    single-GPU spot row: g6e.xlarge, spot rows in us-east-1 0.9154 0.9599 1.0492 1.1975 (median 1.00455)."""
    work_ = work.iteration_work(SD35M)
    sc = estimate.Scenario(0.9, fcurves.Horizon(1, 1), 100.0, boot.Boot(0, 1.0, boot.WeightBytes(0, "-")))
    light = estimate.setup(schedules.SCHEDULES[3], SD35M, work_, sc, "us-east-1")
    assert (light.explorers.accelerator, light.explorers.instance_type, light.explorer_count) == ("L40S:1", "g6e.xlarge", 2)
    assert light.explorers.use_spot and light.explorers.usd_per_hour == pytest.approx((0.9599 + 1.0492) / 2)
    assert light.explorers.dropped == ("A100:1", "A100-80GB:1", "H100:1")
    assert (light.trainer.accelerator, light.trainer.usd_per_hour, light.trainer.use_spot) == ("L40S:1", 1.861, False)
    assert light.trainer_factor == 1.0  # same GPU: the trainer explores as fast as an explorer
    synced = estimate.setup(schedules.SCHEDULES[2], SD35M, work_, replace(sc, explorers=4), "us-west-2")
    assert (synced.explorers.usd_per_hour, synced.explorers.use_spot, synced.explorer_count) == (1.861, False, 4)
    assert estimate.setup(schedules.ON_DEMAND_SYNC, SD35M, work_, sc, "us-east-1").explorer_count == 0
    with pytest.raises(ForecastError, match=r"placement.explorer: none of A100:1, H100:1 has a spot price in aws us-east-1"):
        worker_offer("explorer", ["A100:1", "H100:1"], True, "aws", "us-east-1")
    assert controller_offer("aws", "us-east-1").usd_per_hour == 0.085  # published: the catalog keeps GPU rows only
    # an explorer GPU unlike the trainer's: dense bf16 ratio (L40S 362 / H100 989 TFLOPS)
    assert work.relative_seconds("L40S:1", "H100:1") == pytest.approx(362 / 989)


def test_the_real_config_iteration_is_counted_as_the_planner_counts_it():
    """sd35m: 16 prompts x 16 images x 10 steps + 256 x 9 trained steps x (3 + 1 KL) = 11776 forwards; the budget
    0.7 x 11776 / 5 = 1648 candidates over 20 prompts, under the shipped cap of 128 each: all of it, in seed
    batches of 8 (8240 forwards). Capped at 64 each instead: 1280 candidates, 20 items of 8 units of 8 seeds x
    5 steps; an evaluation: 256 prompts x 1 seed x 40 steps."""
    shipped = work.iteration_work(SD35M)
    assert sum(shipped.candidates) == 1648 and shipped.explore_forwards == 1648 * 5
    assert all(c % 8 == 0 and 8 <= c <= 128 for c in shipped.candidates) and len(shipped.candidates) == 20
    w = work.iteration_work(load_config(REPO / "configs/sd35m-pickscore.yaml",
                                        ["exploration.max_candidates_per_prompt=64"]))
    assert (w.update_forwards, w.candidates, w.explore_forwards, w.evaluate_forwards) == (11776, (64,) * 20, 6400, 10240)
    items = w.items(0.5)
    assert len(items) == 20 and all(item == [20.0] * 8 for item in items)
    assert work.iteration_work(SD35M, width=32).candidates == (32,) * 20
    with pytest.raises(ForecastError, match="multiple of exploration.seeds_per_batch"):
        work.iteration_work(SD35M, width=36)


def test_boot_seconds_from_weight_bytes(tmp_path):
    from spotlight.memory_plan import reward_model_on_meta, worker_weight_bytes

    weights = boot.weight_bytes(SD35M)  # no weights on this machine: the memory plan's count
    assert weights.bytes == worker_weight_bytes(SD35M, "trainer") and "memory plan" in weights.source
    assert 18 * 2**30 < weights.bytes < 20 * 2**30  # SD3.5-M (bf16, VAE fp32) and PickScore (fp32): 18.98 GiB
    assert boot.Boot(240, 2.0, weights).seconds == pytest.approx(240 + weights.bytes / 2e9)
    model = tmp_path / "sd35"
    (model / "transformer").mkdir(parents=True)
    (model / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\0" * 3000)
    (model / "model_index.json").write_text("{}")  # not weights
    on_disk = boot.weight_bytes(load_config(REPO / "configs/sd35m-pickscore.yaml", [f"model.pretrained={model}"]))
    pickscore = sum(p.numel() * p.element_size() for p in reward_model_on_meta(SD35M, "pickscore").parameters())
    assert on_disk.bytes >= 3000 + pickscore and on_disk.bytes - 3000 - pickscore < 2**20  # (+ its buffers)
    assert f"{model} on disk" in on_disk.source


# -- the horizon and the curves ----------------------------------------------------------------------------------
def test_horizon_maps_curve_iterations_onto_the_config():
    h = fcurves.Horizon(20, 1000)
    assert (h.real(4), h.real(3), h.real(20)) == (200, 150, 1000)
    assert fcurves.Horizon(12, 1000).real(5) == 417  # 416.7: a partial iteration is a whole one
    curve = fcurves.Curve("none", 3, tuple(enumerate([0.8, 0.9, 0.95, 0.97])), 20)
    stalled = fcurves.Curve("none", 4, tuple(enumerate([0.8, 0.9])), 20)
    assert fcurves.to_target([curve, stalled], 0.95, h) == [fcurves.ToTarget(3, 100, True),
                                                            fcurves.ToTarget(4, 1000, False)]
    assert "iteration k of 20 -> iteration ceil(50 k) of 1000 (theta_4 -> 200)" in h.describe()
    with pytest.raises(ForecastError, match="ran 20 iterations, the horizon maps 12"):
        fcurves.to_target([curve], 0.95, fcurves.Horizon(12, 1000))


def write_run(root: Path, name: str, rewards: list[float], trainer_seconds: float = 2.0, mode: str = "none",
              width: int | None = None, group: int = 8) -> str:
    """A run store with what a run commits: its config, evaluations, timeline and (exploring) explorations."""
    store = RunStore(f"file://{root / name}")
    cfg = load_config(REPO / "configs/tiny.yaml", [f"exploration.mode={mode}", f"grpo.iterations={max(len(rewards) - 1, 1)}",
                                                   f"grpo.group_size={group}"])
    store.commit("config", {"config.json": json_bytes(cfg.model_dump(mode="json"))})
    for t, reward in enumerate(rewards):
        store.commit(f"evaluations/{t:04d}", {"metrics.json": json_bytes({"iteration": t, "eval_reward": reward})})
    for t in range(len(rewards) - 1):
        store.put_json(f"timeline/{t:04d}.json", {"iteration": t, "critical_path_seconds": trainer_seconds + 0.5,
                                                  "update_seconds": trainer_seconds - 0.25, "explore_wait_seconds": 0.5})
        if width is not None:
            prompts = ["a", "b", "c", "d"]
            store.commit(f"iterations/{t:04d}/explore", {"explored.json": json_bytes({"prompts": prompts}),
                                                         "stats.json": json_bytes({"rollout_seconds": 6.0,
                                                                                   "candidates": width * 4})})
    return store.url


def test_curves_from_every_seed_of_a_bench_folder(tmp_path):
    write_run(tmp_path, "none-s0", [0.80, 0.85, 0.90, 0.92], trainer_seconds=2.0)
    write_run(tmp_path, "none-s1", [0.80, 0.87, 0.92, 0.94], trainer_seconds=4.0)
    write_run(tmp_path, "spotlight-s0", [0.80, 0.91, 0.95, 0.97], mode="spotlight", width=32)
    (tmp_path / "base-abc-s0").mkdir()  # a bench's pretrained base: no evaluations, not a curve
    runs = records.runs_in(tmp_path, ("none", "spotlight"))
    curves = fcurves.by_label([r.curve for r in runs])
    assert [c.seed for c in curves["none"]] == [0, 1] and curves["none"][1].iterations_to(0.92) == 2
    assert [r.width for r in runs] == [None, None, 32] and {r.mode for r in runs} == {"none", "spotlight"}
    assert [s for r in runs if r.mode == "none" for s in r.trainer_seconds] == [2.0] * 3 + [4.0] * 3
    with pytest.raises(ForecastError, match="no committed evaluations"):
        records.read_run("none", 0, write_run(tmp_path, "x-s0", []))


def test_width_lever_picks_the_cheapest_cell(tmp_path):
    """Two widths measured at G = 8 (K/G 2 and 8 -> the sd35m config's 32 and 128 per prompt); the wider
    one reaches the target in half the iterations, so with cheap spot explorers it costs less."""
    write_run(tmp_path, "w16-s0", [0.8, 0.85, 0.9, 0.95, 0.97], mode="spotlight", width=16)
    write_run(tmp_path, "w64-s0", [0.8, 0.9, 0.97, 0.98, 0.98], mode="spotlight", width=64)
    assert real_width(16, 8, SD35M) == 32 and real_width(64, 8, SD35M) == 128 and real_width(40.5, 8, SD35M) == 80
    sc = estimate.Scenario(0.97, fcurves.Horizon(4, 400), 600.0, boot.Boot(240, 1.0, boot.weight_bytes(SD35M)),
                           offsets=2)
    options = width_options(SD35M, sc, records.runs_in(tmp_path), load_traces(zones=["us-west-2b"]), (1, 2))
    assert [(o.label, o.width, o.explorers) for o in options] == [("w16", 32, 1), ("w16", 32, 2), ("w64", 128, 1),
                                                                  ("w64", 128, 2)]
    assert [o.targets[0].iterations for o in options] == [400, 400, 200, 200]
    best = cheapest(options)
    assert best.label == "w64" and best.dollars == min(o.dollars for o in options)


# -- the whole forecast ----------------------------------------------------------------------------------------
def curve(label: str, seed: int, hit: int, length: int = 20) -> fcurves.Curve:
    return fcurves.Curve(label, seed, tuple((t, 0.9 + (0.08 if t >= hit else 0.0)) for t in range(length + 1)), length)


def test_forecast_on_shipped_traces_is_deterministic_and_ordered():
    curves = {"none": [curve("none", s, h) for s, h in enumerate([12, 14])],
              "sync": [curve("sync", s, h) for s, h in enumerate([4, 4])],
              "spotlight": [curve("spotlight", s, h) for s, h in enumerate([3, 4])]}
    sc = estimate.Scenario(0.97, fcurves.Horizon(20, 200), 600.0, boot.Boot(240, 1.0, boot.weight_bytes(SD35M)),
                           offsets=4)
    traces = load_traces(zones=["us-west-2b", "us-east-1f"])
    first, again = (estimate.forecast(SD35M, sc, curves, traces) for _ in range(2))
    assert [(s.targets, s.outcomes) for s in first.schedules] == [(s.targets, s.outcomes) for s in again.schedules]
    base = first.schedule("on-demand sync")
    assert [t.iterations for t in base.targets] == [120, 140] and all(len(o) == 2 for o in base.outcomes.values())
    light = first.schedule("spotlight, on-demand trainer")
    assert all(len(o) == 2 * 4 for o in light.outcomes.values())
    # spot explorers only add work off the critical path: never faster than its iterations' updates
    assert all(o.seconds >= o.iterations * 600 for o in light.all)
    assert sum(o.dollars for o in light.all) / len(light.all) < sum(o.dollars for o in base.all) / len(base.all)
    assert first.schedule("sync exploration, on-demand").all[0].preemptions == 0
    with pytest.raises(ForecastError, match="already met by the base policy"):
        estimate.forecast(SD35M, replace(sc, target=0.85), curves, traces)
    with pytest.raises(ForecastError, match="on-demand sync, the baseline, needs one"):
        estimate.forecast(SD35M, sc, {"spotlight": curves["spotlight"]}, traces)


def test_bounds_when_a_seed_never_reaches_the_target():
    curves = {"none": [curve("none", 0, 10), curve("none", 1, 99)], "spotlight": [curve("spotlight", s, 3) for s in (0, 1)]}
    sc = estimate.Scenario(0.97, fcurves.Horizon(20, 100), 600.0, boot.Boot(0, 1.0, boot.WeightBytes(0, "-")), BEFORE, 2)
    fc = estimate.forecast(SD35M, sc, curves, load_traces(zones=["us-west-2b"]))
    assert fc.schedule("sync exploration, on-demand").outcomes == {}  # no sync curve: not forecast
    base, light = fc.schedule("on-demand sync").all, fc.schedule("spotlight, on-demand trainer").all
    assert report.ratio(base, light, "dollars").startswith("> ")  # the baseline's unreached seed: a lower bound
    assert report.ratio(light, base, "dollars").startswith("< ")
    # the spread over trace offsets: per offset, the seeds' mean against the baseline's seeds' mean in the zone
    light_fc, base_fc = fc.schedule("spotlight, on-demand trainer"), fc.schedule("on-demand sync")
    per_offset = sorted(sum(o.dollars for o in base_fc.all) / 2 / (sum(o.dollars for o in light_fc.all if o.offset == k) / 2)
                        for k in {o.offset for o in light_fc.all})
    p10, p90 = np.percentile(per_offset, [10, 90])
    assert report.over_offsets(base_fc, light_fc, "dollars") == f"> {p10:.2f}-{p90:.2f}"
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(report.summary_table(fc))
    console.print(report.seed_table(fc))
    text = console.export_text()
    assert "1/2" in text and ">100" in text and "no curve" in text


def test_cli_end_to_end_prints_the_tables_and_writes_the_plot(tmp_path):
    bench, sweep = tmp_path / "bench", tmp_path / "widths"
    for seed in (0, 1):
        write_run(bench, f"none-s{seed}", [0.80, 0.85, 0.90, 0.92, 0.95])
        write_run(bench, f"sync-s{seed}", [0.80, 0.90, 0.95, 0.97, 0.98], mode="sync", width=32)
        write_run(bench, f"spotlight-s{seed}", [0.80, 0.91, 0.95, 0.97, 0.98], mode="spotlight", width=32)
        write_run(sweep, f"w16-s{seed}", [0.80, 0.90, 0.93, 0.95, 0.98], mode="spotlight", width=16)
        write_run(sweep, f"w64-s{seed}", [0.80, 0.93, 0.95, 0.97, 0.98], mode="spotlight", width=64)
    plot = tmp_path / "out" / "sim.png"
    proc = subprocess.run([SPOTLIGHT, "simulate", "--config", str(REPO / "configs/sd35m-pickscore.yaml"), "--curves",
                           str(bench), "--target", "0.95", "--update-seconds", "600", "--offsets", "2", "--zones",
                           "us-west-2b,us-east-1f", "--widths", str(sweep), "--width-explorers", "1,2",
                           "--width-offsets", "1", "--plot", str(plot)], cwd=tmp_path,
                          env={**cli_env(tmp_path), "COLUMNS": "250"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    for text in ("on-demand sync", "all-spot sync", "sync exploration, on-demand", "spotlight, on-demand trainer",
                 "us-west-2b", "g6e.xlarge", "curve iteration k of 4 -> iteration ceil(250 k) of 1000", "<- chosen",
                 f"boot {boot.Boot(240, 1.0, boot.weight_bytes(SD35M)).seconds:.0f} s", f"plot: {plot}"):
        assert text in out, text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 20_000


@pytest.mark.parametrize("content, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": []}), "non-empty list"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [1, 1, "0", 1]}), "data[2] = '0'"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [1, 0.5]}), "data[1] = 0.5"),
    (json.dumps({"metadata": {}, "data": [1, 0]}), "gap_seconds"),
    (json.dumps({"metadata": {"gap_seconds": 32}, "data": [0, 0]}), "never held"),
])
def test_malformed_trace_is_refused_naming_it(tmp_path, content, problem):
    path = tmp_path / "us-east-1a_v100_1.json"
    path.write_text(content)
    with pytest.raises(ForecastError, match=re.escape(problem)) as err:
        load_trace(path)
    assert str(path) in str(err.value)


def test_bad_inputs_are_refused_naming_them(tmp_path):
    with pytest.raises(ForecastError, match="no spot trace for zone.*eu-north-9z.*us-east-1c"):
        load_traces(zones=["eu-north-9z"])
    with pytest.raises(ForecastError, match="data\\[1\\] = -1"):
        Trace.from_values([1, -1])
    with pytest.raises(ForecastError, match="horizon 0:1000"):
        fcurves.Horizon(0, 1000)
    with pytest.raises(ForecastError, match="at least one explorer"):
        estimate.Scenario(0.9, fcurves.Horizon(1, 1), 1.0, boot.Boot(0, 1, boot.WeightBytes(0, "")), explorers=0)
    curves = {"none": [curve("none", 0, 2)], "spotlight": [curve("spotlight", 0, 1)]}
    sc = estimate.Scenario(0.97, fcurves.Horizon(20, 20), 30.0, boot.Boot(0, 1.0, boot.WeightBytes(0, "")))
    short = Trace.from_values([1, 1, 0, 1], zone="us-east-1z")  # 20 s windows: a 30 s spot update never fits
    with pytest.raises(ForecastError, match="shorter than one unit of work"):
        estimate.forecast(SD35M, sc, curves, [short])


def test_cli_bad_input_is_one_red_line_and_exit_2(tmp_path):
    bad = tmp_path / "traces"
    bad.mkdir()
    (bad / "us-east-1a_v100_1.json").write_text('{"metadata": {"gap_seconds": 32}, "data": [1, "x"]}')
    write_run(tmp_path / "bench", "none-s0", [0.8, 0.9])
    write_run(tmp_path / "bench", "spotlight-s0", [0.8, 0.95], mode="spotlight", width=32)
    proc = run_cli([SPOTLIGHT, "simulate", "--config", str(REPO / "configs/tiny.yaml"), "--curves",
                    str(tmp_path / "bench"), "--target", "0.9",
                    "--traces", str(bad), "--plot", str(tmp_path / "p.png")], tmp_path, timeout=300)
    assert proc.returncode == 2
    assert "error:" in proc.stderr and "us-east-1a_v100_1.json: data[1] = 'x'" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.png").exists()
