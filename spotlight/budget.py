"""The run's budget cap (``placement.max_dollars``): no iteration starts whose forecast cost would take
the run past the cap.

Why between iterations: that is where nothing is in flight. Every stage the flow posted is committed,
every exploration is drained, so the workers hold nothing when they are told to leave, and a resume
(with a higher cap) continues from the commits exactly as an uncapped run would have: stages are pure
functions of the config and the committed inputs, so the final weights are bit-identical.

The forecast is what has been paid (the cost ledger, plus what the held workers have cost since their
last entry: :func:`spotlight.cost.unrecorded_cost`) plus the costliest iteration so far (an iteration's
entries include the idle time that preceded them). Before the first iteration there is nothing to
forecast from, so only what has been paid counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from spotlight import cost
from spotlight.store import RunStore


@dataclass(frozen=True)
class BudgetCheck:
    """Where the run stands against its cap before an iteration."""

    cap: float
    spent: float          # the ledger's total and the held workers' unrecorded time, in US dollars
    next_iteration: float  # the costliest iteration so far (0 before the first)

    @property
    def forecast(self) -> float:
        return self.spent + self.next_iteration

    @property
    def stops(self) -> bool:
        return self.forecast > self.cap

    def message(self, iteration: int) -> str:
        """One line that names the cap, what was spent, and how to go on."""
        return (f"stopped at the budget cap before iteration {iteration}: placement.max_dollars is "
                f"${self.cap:.4f}; spent ${self.spent:.4f}, and the next iteration (forecast ${self.next_iteration:.4f}, "
                f"the costliest so far) would take it to ${self.forecast:.4f}. Everything done is committed: "
                f"run again with a higher cap (--set placement.max_dollars=...) to continue")


def check(store: RunStore, cap: float, since: float, now: float | None = None) -> BudgetCheck:
    """The run's spending against ``cap``; ``since``: when the current flow run started (its workers'
    unrecorded held time counts, earlier flow runs' workers are gone)."""
    entries = cost.ledger(store)
    now = time.time() if now is None else now
    per_iteration = [dollars for it, dollars in cost.by_iteration(entries).items() if it is not None]
    return BudgetCheck(cap=cap, spent=sum(map(cost.entry_cost, entries)) + cost.unrecorded_cost(entries, since, now),
                       next_iteration=max(per_iteration, default=0.0))
