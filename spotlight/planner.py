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


def exploration_budget(cfg, t: int, prompts: int) -> int:
    """Candidates the exploration pool can roll out while update(t-1) runs, in forward passes
    (``exploration.budget_scale`` x the update's cost); the first iteration, with nothing learned
    and nothing to overlap, explores ``candidates_per_prompt`` per prompt at least."""
    ec, gc = cfg.exploration, cfg.grpo
    update_forwards = update_cost_forwards(gc.prompts_per_iteration * gc.group_size, cfg.sampler.train_steps,
                                           gc.kl_beta > 0)
    budget = int(ec.budget_scale * update_forwards / cfg.exploration_steps)
    return max(budget, ec.candidates_per_prompt * prompts) if t == 0 else budget


def plan_exploration(cfg, t: int, prompts: list[str], state: PlannerState) -> dict:
    """How many candidates each prompt gets this iteration (Thompson sampling within the budget), with
    what the decision was based on: the committed plan of an exploration."""
    from spotlight.seeding import generator

    ec = cfg.exploration
    budget = exploration_budget(cfg, t, len(prompts))
    counts, sampled = plan(state, prompts, group_size=cfg.grpo.group_size, batch=ec.seeds_per_batch,
                           budget_candidates=budget, max_per_prompt=ec.max_candidates_per_prompt,
                           generator=generator(cfg.run.seed, "planner", t))
    return {"counts": counts, "sampled_gain": sampled, "budget_candidates": budget,
            "used_candidates": sum(counts), "posteriors": state.to_json()}
