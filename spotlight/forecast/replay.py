"""The replay: workers with capacity windows taking work, in simulated seconds (floats and iterators only).

* A worker holds capacity in windows (a spot trace's held intervals, or one endless window on demand).
  Each time it gets capacity it boots before it can work: ``boot`` seconds the first time, ``recovery``
  after each preemption (a new VM: provisioning, setup, weights).
* A stage (an update, an evaluation) is one unit: a preemption loses it whole, and the worker redoes it
  after its recovery (the stage queue hands the released attempt to the next trainer).
* An exploration is the run store's work queue (:mod:`spotlight.work_queue`): one item per prompt, one
  unit per seed batch. A free, booted worker claims the next free item and rolls out its pending units
  one after another, each recorded as it finishes. A preemption loses the unit in flight; the item,
  with its remaining units, is free again at that moment (the SIGTERM notice releases it; a worker killed
  without notice would hold it until its lease expires, which the replay does not model). A worker whose
  queue has no free item waits: items held by others are theirs to finish.
"""

from __future__ import annotations

import bisect
import heapq
import math
from typing import Sequence

from spotlight.forecast.traces import Windows

#: an exploration's work: per item (prompt), the seconds of each unit (seed batch) on an explorer
Items = Sequence[Sequence[float]]


class ReplayWorker:
    """One worker's held and warm (booted) windows in simulated seconds, pulled lazily from its trace."""

    def __init__(self, held: Windows, boot: float, recovery: float | None = None):
        self._source, self._boot = held, boot
        self._recovery = boot if recovery is None else recovery
        self.held: list[tuple[float, float]] = []
        self.busy = 0.0  # seconds spent computing, lost work included (the rest of its held time it polls)
        self._warm: list[tuple[float, float]] = []
        self._warm_ends: list[float] = []

    @classmethod
    def on_demand(cls, boot: float) -> ReplayWorker:
        return cls(iter([(0.0, math.inf)]), boot)

    def _cover(self, t: float) -> None:
        while not self._warm_ends or self._warm_ends[-1] <= t:
            start, end = next(self._source)
            self.held.append((start, end))
            booted = start + (self._boot if len(self.held) == 1 else self._recovery)
            if booted < end:
                self._warm.append((booted, end))
                self._warm_ends.append(end)

    def next_warm(self, t: float) -> tuple[float, float]:
        """The first moment >= t at which the worker is booted, and when that window ends."""
        self._cover(t)
        start, end = self._warm[bisect.bisect_right(self._warm_ends, t)]
        return max(start, t), end

    def warm_over(self, a: float, b: float) -> bool:
        """Booted and holding capacity from a through b, without a break."""
        start, end = self.next_warm(a)
        return start == a and end >= b

    def held_seconds(self, until: float) -> float:
        """Seconds with an instance (boots and idle time included: what is billed) up to ``until``."""
        self._cover(until)
        return sum(min(b, until) - a for a, b in self.held if a < until)

    def preemptions(self, until: float) -> int:
        self._cover(until)
        return sum(1 for _, b in self.held if b < until)


def run_stage(worker: ReplayWorker, start: float, seconds: float) -> float:
    """When a stage of ``seconds`` started (queued) at ``start`` commits: redone whole after a preemption."""
    t = start
    while True:
        begin, end = worker.next_warm(t)
        if begin + seconds <= end:
            worker.busy += seconds
            return begin + seconds
        worker.busy += end - begin
        t = end


def run_items(workers: Sequence[ReplayWorker], start: float, items: Items, joins_at: dict[int, float] | None = None,
              factors: Sequence[float] | None = None) -> float:
    """When the last item of an exploration published at ``start`` is done.

    ``joins_at``: worker index -> when it may start claiming (default ``start``): the trainer joins when
    its update commits. ``factors``: per worker, its seconds per explorer-second of work (a trainer on
    a faster GPU: < 1). The earliest free worker claims first; free items go lowest index first.
    """
    joins, slow = joins_at or {}, factors or [1.0] * len(workers)
    free = [(start, i, 0) for i in range(len(items))]  # (free from, item, next unit): a heap
    ready = sorted((w.next_warm(max(start, joins.get(j, start)))[0], j) for j, w in enumerate(workers))
    left, last = len(items), start
    while left:
        t, j = heapq.heappop(ready)
        if free[0][0] > t:  # every unfinished item is held by another worker until then
            heapq.heappush(ready, (workers[j].next_warm(free[0][0])[0], j))
            continue
        _, item, unit = heapq.heappop(free)
        t, window_end = workers[j].next_warm(t)
        units, began = items[item], t
        while unit < len(units) and t + units[unit] * slow[j] <= window_end:
            t += units[unit] * slow[j]
            unit += 1
        workers[j].busy += (t if unit == len(units) else window_end) - began
        if unit == len(units):
            left, last = left - 1, max(last, t)
            heapq.heappush(ready, (workers[j].next_warm(t)[0], j))
        else:  # preempted: the unit in flight is lost, the item is free again
            heapq.heappush(free, (window_end, item, unit))
            heapq.heappush(ready, (workers[j].next_warm(window_end)[0], j))
    return last


class Exploration:
    """One iteration's exploration, replayed many times: caches how long it takes when every worker
    stays up, so only explorations a preemption touches are replayed unit by unit."""

    def __init__(self, items: Items, factors: Sequence[float]):
        self.items, self.factors = items, tuple(factors)
        self._all_up: dict[tuple[float, ...], tuple[float, tuple[float, ...]]] = {}  # joins -> (took, busy)

    def finish(self, workers: Sequence[ReplayWorker], start: float, joins_at: dict[int, float] | None = None) -> float:
        joins = {j: max(start, t) for j, t in (joins_at or {}).items()}
        key = tuple(joins.get(j, start) - start for j in range(len(workers)))
        if key not in self._all_up:
            if len(self._all_up) > 256:  # a spot trainer's join times vary: do not keep them all
                return run_items(workers, start, self.items, joins, self.factors)
            always = [ReplayWorker(iter([(0.0, math.inf)]), 0.0) for _ in workers]
            took = run_items(always, 0.0, self.items, dict(enumerate(key)), self.factors)
            self._all_up[key] = took, tuple(w.busy for w in always)
        took, busy = self._all_up[key]
        if all(w.warm_over(joins.get(j, start), start + took) for j, w in enumerate(workers)):
            for w, b in zip(workers, busy):
                w.busy += b
            return start + took
        return run_items(workers, start, self.items, joins, self.factors)
