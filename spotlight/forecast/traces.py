"""Spot capacity traces: when a zone had an instance to give, tick by tick.

A trace file is ``{"metadata": {"gap_seconds": N}, "data": [ints]}`` (skypilot-org/spot-traces); the
shipped ones are four AWS zones of 1x V100 (``sky/traces/``). A value > 0 means capacity is held during
that tick; a drop to 0 is a preemption. A trace is replayed from a start offset and wraps around at
its end. Tests build one with :meth:`Trace.from_values`, no file needed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from functools import cached_property
from itertools import count
from pathlib import Path
from typing import Iterator

from spotlight.forecast.errors import ForecastError

REPO = Path(__file__).resolve().parents[2]
TRACES_DIR = REPO / "sky" / "traces" / "aws-v100-1node-2023-04-22"

#: held capacity windows in simulated seconds: (start, end), ordered, disjoint
Windows = Iterator[tuple[float, float]]


@dataclass(frozen=True)
class Trace:
    """One zone's capacity over time: ``values[i]`` instances held during tick i."""

    zone: str
    gap_seconds: int
    values: tuple[int, ...]
    path: Path | None = None  # None: built in memory

    @classmethod
    def from_values(cls, values: list[int], gap_seconds: int = 10, zone: str = "us-test-1a") -> Trace:
        """A trace from its values, checked as a file's would be (for tests and what-if inputs)."""
        return cls(zone, gap_seconds, tuple(_checked(values, gap_seconds, f"trace of zone {zone}")))

    @property
    def source(self) -> str:
        return str(self.path) if self.path else f"in-memory trace of {self.zone}"

    @property
    def region(self) -> str:
        """The zone's region (``us-east-1c`` -> ``us-east-1``): where its prices are read."""
        return re.sub(r"-?[a-z]$", "", self.zone)

    @property
    def period(self) -> int:
        return len(self.values) * self.gap_seconds

    @cached_property
    def held_runs(self) -> tuple[tuple[int, int], ...]:
        """The held intervals of one pass over the trace, in seconds from its first tick."""
        runs, start = [], None
        for i, v in enumerate(self.values + (0,)):
            if v > 0 and start is None:
                start = i
            elif v == 0 and start is not None:
                runs.append((start * self.gap_seconds, i * self.gap_seconds))
                start = None
        return tuple(runs)

    @property
    def preemptions(self) -> int:
        """Drops from held to 0 within the file."""
        return sum(1 for a, b in zip(self.values, self.values[1:]) if a > 0 and b == 0)

    def held_from(self, offset: int) -> Windows:
        """Held intervals in simulated seconds, replaying from tick ``offset`` and wrapping around at the
        end (intervals that touch across the wrap are one: no preemption there)."""
        if self.held_runs == ((0, self.period),):
            yield 0.0, math.inf
            return
        shift, current = offset * self.gap_seconds, None
        for cycle in count():
            for a, b in self.held_runs:
                a, b = a + cycle * self.period - shift, b + cycle * self.period - shift
                if b <= 0:
                    continue
                a = max(a, 0)
                if current is not None and current[1] == a:
                    current = (current[0], b)
                    continue
                if current is not None:
                    yield float(current[0]), float(current[1])
                current = (a, b)


def _checked(data: object, gap: object, where: str) -> list[int]:
    if type(gap) is not int or gap <= 0:
        raise ForecastError(f"{where}: metadata.gap_seconds must be a positive integer, got {gap!r}")
    if not isinstance(data, list) or not data:
        raise ForecastError(f"{where}: 'data' must be a non-empty list of integers")
    bad = next((i for i, v in enumerate(data) if type(v) is not int or v < 0), None)
    if bad is not None:
        raise ForecastError(f"{where}: data[{bad}] = {data[bad]!r} is not a non-negative integer")
    if not any(data):
        raise ForecastError(f"{where}: capacity is never held (every value is 0)")
    return data


def load_trace(path: Path) -> Trace:
    """Read and check one trace file; the zone is the file name's first ``_``-separated part."""
    where = f"spot trace {path}"
    if not path.is_file():
        raise ForecastError(f"{where}: no such file")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ForecastError(f"{where}: not valid JSON ({e})") from None
    meta = raw.get("metadata") if isinstance(raw, dict) else None
    gap = meta.get("gap_seconds") if isinstance(meta, dict) else None
    data = _checked(raw.get("data") if isinstance(raw, dict) else None, gap, where)
    return Trace(zone=path.stem.split("_")[0], gap_seconds=gap, values=tuple(data), path=path)


def load_traces(directory: Path = TRACES_DIR, zones: list[str] | None = None) -> list[Trace]:
    """The traces of a folder (one ``<zone>_*.json`` per zone), all or the named zones."""
    if not directory.is_dir():
        raise ForecastError(f"spot trace folder {directory}: no such folder")
    paths = {p.stem.split("_")[0]: p for p in sorted(directory.glob("*.json"))}
    if not paths:
        raise ForecastError(f"spot trace folder {directory}: no *.json trace files")
    unknown = [z for z in zones or [] if z not in paths]
    if unknown:
        raise ForecastError(f"no spot trace for zone(s) {', '.join(unknown)} in {directory}; "
                            f"zones there: {', '.join(paths)}")
    return [load_trace(paths[z]) for z in (zones or list(paths))]


def start_offsets(trace: Trace, n: int) -> list[int]:
    """``n`` evenly spaced start ticks over the trace."""
    return [k * len(trace.values) // n for k in range(n)]
