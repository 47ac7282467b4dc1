"""The bandit exploration planner: how many candidate seeds each prompt gets this iteration.

Budget. Exploration runs while the update step runs, so its budget is what the exploration workers
can roll out in the update's time. We state both in forward-pass equivalents (deterministic, so a
resumed run plans exactly as before): an update costs N*S forwards for its rollouts plus ~3 per
(sample, step) row for the PPO pass (+1 with a KL reference); a candidate costs S_explore forwards.
The measured seconds are recorded next to the plan (budget used vs available).

Allocation: Thompson sampling over prompts (Gaussian posterior per prompt on the *variance gain*:
std of the filtered group minus std of a random group). Why Thompson: prompts are few and their
value drifts as the policy learns; posterior sampling keeps exploring prompts that look saturated
without a tuned exploration constant (UCB's), and it spends budget proportionally instead of
all-or-nothing. Every prompt gets at least G candidates (the filter needs a group); the rest of the
budget goes in proportion to each prompt's sampled gain, in whole seed batches, capped per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PromptPosterior:
    """Gaussian posterior on a prompt's variance gain, with known observation noise."""

    mean: float = 0.1
    var: float = 0.01
    observations: int = 0

    def update(self, gain: float, noise_var: float = 0.0025) -> None:
        precision = 1 / self.var + 1 / noise_var
        self.mean = (self.mean / self.var + gain / noise_var) / precision
        self.var = 1 / precision
        self.observations += 1


@dataclass
class PlannerState:
    posteriors: dict[str, PromptPosterior] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {p: vars(q) for p, q in sorted(self.posteriors.items())}

    @staticmethod
    def from_json(data: dict) -> "PlannerState":
        return PlannerState({p: PromptPosterior(**q) for p, q in data.items()})

    def observe(self, prompt: str, gain: float) -> None:
        self.posteriors.setdefault(prompt, PromptPosterior()).update(gain)


def update_cost_forwards(samples: int, steps: int, kl: bool) -> int:
    """Forward-pass equivalents of one update step (rollouts + PPO pass over every (sample, step) row)."""
    return samples * steps * (1 + 3 + (1 if kl else 0))


def plan(state: PlannerState, prompts: list[str], *, group_size: int, batch: int, budget_candidates: int,
         max_per_prompt: int, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Candidates per prompt (multiples of ``batch``, >= group_size, <= max_per_prompt) and the sampled gains."""
    floor = -(-group_size // batch) * batch
    cap = max(floor, max_per_prompt // batch * batch)
    counts = [floor] * len(prompts)
    samples = []
    for p in prompts:
        post = state.posteriors.get(p, PromptPosterior())
        samples.append(post.mean + post.var**0.5 * torch.randn((), generator=generator).item())
    extra_batches = max(0, (budget_candidates - sum(counts)) // batch)
    weights = torch.tensor([max(s, 0.0) for s in samples], dtype=torch.float64) + 1e-6
    while extra_batches > 0:
        open_ = [i for i, c in enumerate(counts) if c + batch <= cap]
        if not open_:
            break
        w = weights[open_] / (torch.tensor([counts[i] for i in open_], dtype=torch.float64))
        i = open_[int(torch.argmax(w))]  # the prompt with most sampled gain per candidate it already has
        counts[i] += batch
        extra_batches -= 1
    return counts, samples
