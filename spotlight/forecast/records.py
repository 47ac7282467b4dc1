"""What real runs recorded, read from their run stores: the only part of the forecast that reads a store.

A bench folder (``bench/time_to_target.py --out``, ``bench/iterations_to_target.py --out``) holds one run
store per ``<label>-s<seed>``. Each gives a reward curve (``evaluations/NNNN``), its config (mode, length,
group size), the width it explored (``iterations/NNNN/explore``: candidates per explored prompt) and,
where the flow ran it, its CPU stage times (``timeline/``, ``explore/stats.json``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

from spotlight.forecast.curves import Curve
from spotlight.forecast.errors import ForecastError
from spotlight.store import RunStore, StoreError

RUN_NAME = re.compile(r"([a-z][a-z0-9-]*?)-s(\d+)")


@dataclass(frozen=True)
class RunRecord:
    """What the forecast needs from one run store."""

    curve: Curve
    mode: str  # exploration.mode: none, sync, spotlight
    group_size: int
    width: float | None  # mean candidates per explored prompt (None: nothing explored)
    trainer_seconds: tuple[float, ...]  # per iteration: critical path minus waits for exploration

    @property
    def label(self) -> str:
        return self.curve.label


def read_run(label: str, seed: int, url: str) -> RunRecord:
    """One run store's curve, config, explored width and stage seconds."""
    try:
        store = RunStore(url)
        if not store.is_committed("config"):
            raise ForecastError(f"run store {url}: no committed config (not a run store?)")
        cfg = store.load("config").json("config.json")
        rewards = {int(n): float(store.load(f"evaluations/{n}").json("metrics.json")["eval_reward"])
                   for n in store.list("evaluations") if n.isdigit() and store.is_committed(f"evaluations/{n}")}
        explores = [store.load(f"iterations/{n}/explore") for n in store.list("iterations")
                    if store.is_committed(f"iterations/{n}/explore")]
        widths = [c.json("stats.json")["candidates"] / len(c.json("explored.json")["prompts"]) for c in explores
                  if "stats.json" in c.manifest["objects"]]  # an exploration that explored (mode none writes no stats)
        timeline = [store.get_json(f"timeline/{n}") for n in store.list("timeline") if n.endswith(".json")]
    except (StoreError, KeyError, ValueError, TypeError, ZeroDivisionError) as e:
        raise ForecastError(f"run store {url}: unreadable record: {e!r}") from None
    if not rewards:
        raise ForecastError(f"run store {url}: no committed evaluations (evaluations/NNNN/metrics.json)")
    width, group = fmean(widths) if widths else None, int(cfg["grpo"]["group_size"])
    curve = Curve(label, seed, tuple(sorted(rewards.items())), int(cfg["grpo"]["iterations"]), url, width, group)
    return RunRecord(curve, cfg["exploration"]["mode"], group, width,
                     tuple(t["critical_path_seconds"] - t["explore_wait_seconds"] for t in timeline))


def runs_in(folder: Path, labels: tuple[str, ...] | None = None) -> list[RunRecord]:
    """The run stores of a bench folder, all or those whose label is in ``labels``."""
    if not folder.is_dir():
        raise ForecastError(f"curves folder {folder}: no such folder")
    found = []
    for path in sorted(folder.iterdir()):
        m = RUN_NAME.fullmatch(path.name)
        # a run that evaluated (a bench's pretrained base, ``base-<fingerprint>-s<seed>``, did not)
        if m and (path / "evaluations").is_dir() and (labels is None or m[1] in labels):
            found.append(read_run(m[1], int(m[2]), f"file://{path.resolve()}"))
    if not found:
        wanted = f" labelled {', '.join(labels)}" if labels else ""
        raise ForecastError(f"curves folder {folder}: no run stores{wanted} named <label>-s<seed>")
    return found
