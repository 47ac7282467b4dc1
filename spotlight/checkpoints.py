"""Checkpoint retention: which policies (and optimizer states) the run store keeps.

update(s) commits theta_{s+1}: its policy (with LoRA only the adapter), its EMA when ``grpo.ema`` is on,
and its optimizer state. A
long run keeps the newest ``checkpoint.keep_last`` policies — resume needs the newest with its
optimizer state, exploration reads theta_{t-1} while update(t) writes theta_{t+1}, evaluation
reads the newest — and every ``keep_every``-th for the record. Pruning runs only after a newer
commit is complete, writes a tombstone naming what it removes before removing it (so a reader gets
"pruned", never a bare missing file), and is idempotent: a prune killed midway is finished by the next.
It also sweeps the two newest iterations' attempt objects that no manifest references (a writer that lost
a commit race and died before deleting its attempt, or one killed mid-commit and since superseded).
"""

from __future__ import annotations

import posixpath
from typing import Callable

from spotlight.config import CheckpointSection
from spotlight.store import RunStore

POLICY, OPTIMIZER = "policy.safetensors", "optimizer.safetensors"
EMA = "ema.safetensors"  # grpo.ema's average of the weights: kept with the policy, which evaluation and export read
LOOKBACK = 8  # iterations behind the retention window re-checked, to finish an interrupted prune


def kept_objects(cfg: CheckpointSection, s: int, newest: int) -> set[str]:
    """What update(s)'s commit keeps once update(newest) is committed."""
    if cfg.keep_last is None or s == newest:
        return {POLICY, EMA, OPTIMIZER}
    keep_policy = s > newest - cfg.keep_last or (cfg.keep_every is not None and (s + 1) % cfg.keep_every == 0)
    return {POLICY, EMA} if keep_policy else set()


def prune(store: RunStore, cfg: CheckpointSection, newest: int, key: Callable[[str, int], str]) -> list[str]:
    """Remove what retention no longer keeps behind update(newest), and the attempt objects no manifest
    references in iterations newest - 1 and newest (``RunStore.sweep``); returns the removed object keys."""
    removed = [k for s in sorted({max(0, newest - 1), newest})  # losers and dead writers of these iterations
               for k in store.sweep(posixpath.dirname(key("update", s)))]
    if cfg.keep_last is None:
        return removed
    for s in range(max(0, newest - cfg.keep_last - LOOKBACK), newest):
        name = key("update", s)
        if not store.is_committed(name):
            continue
        commit = store.load(name)
        drop = sorted({POLICY, EMA, OPTIMIZER} - kept_objects(cfg, s, newest))
        present = [obj for obj in drop if obj in commit.manifest["objects"] and store.exists(commit.key(obj))]
        if not present:
            continue
        store.tombstone(name, present, f"pruned by checkpoint retention (keep_last={cfg.keep_last}, "
                                       f"keep_every={cfg.keep_every}) after iteration {newest}")
        for obj in present:
            store.delete(commit.key(obj))
            removed.append(commit.key(obj))
    return removed
