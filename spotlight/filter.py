"""The variance filter: per prompt, keep the G explored seeds whose rewards differ most.

Group-relative RL learns nothing from a group whose rewards are all equal, so we keep, per prompt,
the size-G subset of candidates with the largest reward variance. That subset is always some of the
lowest plus the rest of the highest rewards (moving any kept middle value outward cannot lower the
variance), so trying the G + 1 low/high splits of the sorted rewards finds the optimum exactly.
Across prompts, the stage keeps the P groups with the most variance, so low-variance prompts are
replaced by the extra prompt groups that were explored (the update always trains P groups).

``exploration.variance_seeds`` < G keeps the first G - n candidates as drawn (the seeds mode ``none``
would train) and chooses only n for variance: the group then holds typical samples beside the tails.
The optimum is still a low/high split, of the candidates left (the group's variance is convex in each
chosen value), so the n + 1 splits are tried.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Selection:
    seeds: list[int]
    rewards: list[float]
    std: float  # std of the kept group (unbiased, as the advantages use)
    random_std: float  # std of the first G candidates: what mode "none" would have trained on
    candidates_std: float  # std of all candidates (unbiased): what the planner learns from, fair at every count


def max_variance_subset(rewards: torch.Tensor, g: int, chosen: int | None = None) -> tuple[torch.Tensor, float]:
    """Indices of the size-g subset of ``rewards`` with maximum variance, and that subset's std. ``chosen``
    (< g): the first g - chosen indices are kept as they are, and only ``chosen`` are picked among the rest."""
    if len(rewards) < g:
        raise ValueError(f"need at least {g} candidates, got {len(rewards)}")
    n = g if chosen is None else min(chosen, g)
    fixed = torch.arange(g - n)
    order = (g - n) + torch.argsort(rewards[g - n:], stable=True)
    best, best_std = torch.cat([fixed, order[:n]]), -1.0
    for low in range(n + 1):
        idx = torch.cat([fixed, order[:low], order[len(order) - (n - low):] if n - low else order[:0]])
        std = rewards[idx].std().item()
        if std > best_std + 1e-12:
            best, best_std = idx, std
    return torch.sort(best).values, best_std


def select(seeds: list[int], rewards: list[float], g: int, chosen: int | None = None) -> Selection:
    r = torch.tensor(rewards, dtype=torch.float64)
    idx, std = max_variance_subset(r, g, chosen)
    return Selection([seeds[i] for i in idx.tolist()], [rewards[i] for i in idx.tolist()], std,
                     r[:g].std().item(), r.std().item())


def first_group(seeds: list[int], rewards: list[float], g: int) -> Selection:
    """The first G candidates, unselected: the group mode ``none`` trains on (paired seeds)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    return Selection(seeds[:g], rewards[:g], r[:g].std().item(), r[:g].std().item(), r.std().item())


def keep_most_informative(prompts: list[str], seeds: list[list[int]], rewards: list[list[float]], g: int,
                          keep: int, min_std: float, select_seeds: bool = True, variance_seeds: int | None = None,
                          variance_groups: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per prompt the max-variance group of G seeds, then the ``keep`` prompt groups with the most
    variance (low-variance prompts are replaced by the extra ones explored): the filtered table
    ``{"prompts", "seeds"}`` and its statistics (a row per explored prompt: what the planner learns from).

    ``select_seeds=False`` (the prompt-selection-only ablation): each prompt's group is its first G
    candidates, and prompts are ranked by that group's std, so only the choice of prompts differs
    from mode ``none``. (Seed-selection only is the default filter with no extra prompts drawn.)
    ``variance_seeds``: of each group, how many are chosen for variance (the rest: its first candidates).
    ``variance_groups``: of the kept groups, how many (those of most variance) train their chosen seeds;
    the others train their first G candidates, as drawn (each group's advantages are its own, so these
    keep a typical sample's gradient at full strength)."""
    rows, selections = [], []
    for prompt, row_seeds, row_rewards in zip(prompts, seeds, rewards):
        sel = (select(row_seeds, row_rewards, g, variance_seeds) if select_seeds
               else first_group(row_seeds, row_rewards, g))
        selections.append(sel)
        rows.append({"prompt": prompt, "candidates": len(row_seeds), "std": sel.std, "random_std": sel.random_std,
                     "candidates_std": sel.candidates_std, "gain": sel.std - sel.random_std, "kept": False})
    ranked = sorted(range(len(rows)), key=lambda i: (-rows[i]["std"], i))[:keep]
    for i in ranked[keep if variance_groups is None else variance_groups:]:
        selections[i] = first_group(seeds[i], rewards[i], g)
        rows[i] |= {"std": selections[i].std, "gain": 0.0}
    best = sorted(ranked)
    for i in best:
        rows[i]["kept"] = True
    kept = {"prompts": [prompts[i] for i in best], "seeds": [selections[i].seeds for i in best]}
    kept_rows = [r for r in rows if r["kept"]]
    stats = {"prompts": rows, "selected_std": sum(r["std"] for r in kept_rows) / len(kept_rows),
             "random_std": sum(r["random_std"] for r in rows) / len(rows),
             "replaced_fraction": 1 - len(kept_rows) / len(rows),
             "low_variance_kept": sum(r["std"] < min_std for r in kept_rows)}
    return kept, stats
