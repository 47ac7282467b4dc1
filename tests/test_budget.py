"""The budget cap's arithmetic on hand-made ledgers: what has been paid, what held workers owe since their
last entry, the forecast of the next iteration, and the one-line message that names the cap."""

from __future__ import annotations

import pytest

from spotlight import budget, cost
from spotlight.config import load_config
from spotlight.store import RunStore


def _entry(store: RunStore, stage: str, iteration: int | None, seconds: float, price: float, worker: str,
           outcome: str = "ok", idle: float = 0.0) -> float:
    """Write an entry and return when it was recorded."""
    return cost.record(store, stage, iteration, seconds, price, worker, worker=worker, outcome=outcome,
                       idle_seconds=idle)["recorded_at"]


def test_spent_forecast_and_stop_by_hand(tmp_path):
    store = RunStore(f"file://{tmp_path}/run")
    since = 0.0
    _entry(store, "boot", None, 36, 10.0, "trainer")                  # $0.10
    _entry(store, "update", 0, 360, 10.0, "trainer", idle=36)         # $1.00 + $0.10 idle: iteration 0 $1.10
    _entry(store, "explore", 1, 720, 1.0, "explorer")                 # $0.20
    last = _entry(store, "update", 1, 180, 10.0, "trainer")           # $0.50: iteration 1 $0.70
    _entry(store, "idle", None, 0, 1.0, "explorer", outcome="exit", idle=3600)  # $1.00, and it has left
    now = last + 360  # the trainer has been held 360 s since its last entry: $1.00 not in the ledger yet
    check = budget.check(store, cap=4.0, since=since, now=now)
    assert check.spent == pytest.approx(0.10 + 1.10 + 0.20 + 0.50 + 1.00 + 1.00)  # 3.90
    assert check.next_iteration == pytest.approx(1.10)  # the costliest iteration so far
    assert check.forecast == pytest.approx(5.00) and check.stops
    assert not budget.check(store, cap=5.0, since=since, now=now).stops  # reaching the cap exactly is allowed
    # a worker from an earlier flow run (last entry before `since`) is gone: its time is not owed
    assert budget.check(store, cap=4.0, since=last + 1, now=now).spent == pytest.approx(2.90)
    message = " ".join(check.message(2).split())
    assert "before iteration 2: placement.max_dollars is $4.0000; spent $3.9000" in message
    assert "forecast $1.1000" in message and "--set placement.max_dollars=" in message


def test_an_empty_ledger_forecasts_nothing(tmp_path):
    check = budget.check(RunStore(f"file://{tmp_path}/run"), cap=0.01, since=0.0, now=100.0)
    assert (check.spent, check.next_iteration, check.stops) == (0.0, 0.0, False)


def test_the_cap_and_the_flow_timeout_are_placement_and_must_be_positive():
    cfg = load_config("configs/tiny.yaml", ["placement.max_dollars=12.5", "placement.flow_timeout_hours=6"])
    assert cfg.placement.max_dollars == 12.5 and cfg.placement.flow_timeout_hours == 6
    assert cfg.recipe() == load_config("configs/tiny.yaml").recipe()  # a resume may raise the cap
    for bad in ("placement.max_dollars=0", "placement.flow_timeout_hours=-1"):
        with pytest.raises(Exception, match="greater than 0"):
            load_config("configs/tiny.yaml", [bad])


def test_waiting_is_counted_apart_from_the_idle_time_around_the_work(tmp_path):
    """A worker's rounds that found no work (Ledger.waited) go into its next entry as waiting_seconds and
    waiting_requests; the requests of claims and reads around the work stay in idle_requests only. The rate
    per process is the waiting requests over the waiting seconds, summed over its entries."""
    from spotlight.store import RequestCounts

    store = RunStore(f"file://{tmp_path}/run")
    ledger = cost.Ledger(store, "w1", "explorer", 3.6)
    ledger.waited(4.0, RequestCounts(get=1))
    ledger.waited(4.0, RequestCounts(get=1))
    ledger.record("explore", 0, 10.0, cost.Outcome.OK, 8.0)
    ledger.waited(2.0, RequestCounts(put=1, get=2))
    ledger.record("idle", None, 0.0, cost.Outcome.EXIT, 2.0)
    entries = sorted(cost.ledger(store), key=lambda e: e["recorded_at"])
    assert [(e["waiting_seconds"], e["waiting_requests"]["get"]) for e in entries] == [(8.0, 2), (2.0, 2)]
    assert cost.requests_per_second_waiting(entries) == {"w1": pytest.approx((2 + 3) / 10.0)}


def test_a_process_start_time_lies_between_its_launch_and_its_first_line():
    """The ledger bills a worker from its process's start: never before it was launched (``btime`` in
    /proc/stat is truncated to the second, which put starts up to a second early), never after it ran."""
    import subprocess
    import sys
    import time

    code = "import time; ran = time.time(); from spotlight.cost import process_start_time; print(ran, process_start_time())"
    for _ in range(3):
        launched = time.time()
        ran, started = map(float, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                                 check=True).stdout.split())
        assert launched - 0.02 <= started <= ran, (launched, started, ran)
