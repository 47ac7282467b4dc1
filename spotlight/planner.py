"""The bandit exploration planner: how many candidate seeds each prompt gets this iteration.

Budget. Exploration runs while the update step runs, so its budget is what the exploration workers
can roll out in the update's time. We state both in forward-pass equivalents (deterministic, so a
resumed run plans exactly as before): an update costs N*S forwards for its rollouts plus ~3 per
trained (sample, step) row for the PPO pass (+1 with a KL reference; ``sampler.timestep_fraction``
says how many steps per rollout are trained); a candidate costs S_explore forwards.
The measured seconds are recorded next to the plan (budget used vs available).

Allocation: Thompson sampling over prompts on each prompt's *reward variance* (of its candidates,
under the exploring policy). We do not learn the variance gain (std of the filtered group minus std
of a random group) directly: it grows with the number of candidates K by itself (i.i.d. uniform
rewards: 0.103, 0.171, 0.214 at K = 16, 32, 64 for G = 8), so a prompt given more candidates would
look better and get more again. The unbiased sample variance of K candidates has the same
expectation at every K (for any reward distribution), so it is a K-fair signal; the value of giving
a prompt more candidates is then derived from it: under i.i.d. rewards of spread sigma, the gain of
K candidates is sigma * (e(K) - e(G)) (:func:`gain_curve`), and each extra seed batch goes to the
prompt whose sampled sigma gains most from it (diminishing returns spread the budget). Why Thompson:
prompts are few and their value drifts as the policy learns; posterior sampling keeps exploring
prompts that look saturated without a tuned exploration constant (UCB's). The posterior forgets:
every iteration the weight of what was observed shrinks by ``DISCOUNT``, so a prompt's estimate
follows the policy instead of averaging over its whole history. Every prompt gets at least G
candidates (the filter needs a group), in whole seed batches, capped per prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from spotlight.filter import max_variance_subset

# Prior on a prompt's reward variance before any observation: inverse-gamma with mean 0.04 (std 0.2),
# worth two degrees of freedom, with a heavy upper tail (a prompt never seen is worth exploring).
PRIOR_SHAPE, PRIOR_SCALE = 2.0, 0.04
# Per-iteration weight kept by past observations: a half-life of one iteration, since every prompt of
# an iteration is observed and the reward spread of the tiny model changes within a few iterations.
DISCOUNT = 0.5


@dataclass
class PromptPosterior:
    """Inverse-gamma posterior on a prompt's reward variance: conjugate to the sample variance s^2 of
    K normal rewards ((K - 1) s^2 / sigma^2 ~ chi^2 with K - 1 degrees of freedom), never negative,
    and as uncertain as the spread itself. Observations are kept as discounted sums, so forgetting is
    a multiplication and the prior is never forgotten."""

    dof: float = 0.0  # sum of (K - 1) over the observations, discounted
    squares: float = 0.0  # sum of (K - 1) * s^2 over the observations, discounted
    observations: int = 0

    @property
    def shape(self) -> float:
        return PRIOR_SHAPE + self.dof / 2

    @property
    def scale(self) -> float:
        return PRIOR_SCALE + self.squares / 2

    @property
    def mean(self) -> float:
        """Posterior mean of the variance: a (K - 1)-weighted mean of unbiased estimates, plus the prior."""
        return self.scale / (self.shape - 1)

    def update(self, variance: float, candidates: int) -> None:
        self.dof += candidates - 1
        self.squares += (candidates - 1) * variance
        self.observations += 1

    def forget(self, discount: float) -> None:
        self.dof *= discount
        self.squares *= discount

    def sample(self, rng: random.Random) -> float:
        """A variance drawn from the posterior (Thompson sampling)."""
        return self.scale / rng.gammavariate(self.shape, 1.0)


@dataclass
class PlannerState:
    posteriors: dict[str, PromptPosterior] = field(default_factory=dict)
    discount: float = DISCOUNT

    def to_json(self) -> dict:
        return {p: {**vars(q), "mean_variance": q.mean} for p, q in sorted(self.posteriors.items())}

    def observe(self, prompt: str, candidates_std: float, candidates: int) -> None:
        """One filtered prompt: the (unbiased) std of all its ``candidates`` explored rewards."""
        if candidates < 2:
            raise ValueError(f"a reward variance needs at least 2 candidates, got {candidates}")
        self.posteriors.setdefault(prompt, PromptPosterior()).update(candidates_std**2, candidates)

    def forget(self) -> None:
        """One iteration passes: every observation so far weighs ``discount`` times less."""
        for post in self.posteriors.values():
            post.forget(self.discount)


@lru_cache(maxsize=None)
def gain_curve(k: int, g: int) -> float:
    """e(K): the std of the max-variance size-g group of k i.i.d. rewards, in units of the rewards' std.

    Computed on the expected order statistics of uniform rewards (i / (k + 1)): bounded like the
    rewards here (a normal reference would promise gains that bounded rewards never give),
    deterministic (a resumed run plans the same), and within ~10% of the simulated gain
    e(K) - e(G) of i.i.d. uniform rewards and of its steps between counts (a test checks both).
    """
    expected = torch.arange(1, k + 1, dtype=torch.float64) / (k + 1)
    return max_variance_subset(expected, g)[1] * 12**0.5


def update_cost_forwards(samples: int, steps: int, kl: bool, trained_steps: int | None = None) -> int:
    """Forward-pass equivalents of one update step: the rollouts (``steps`` forwards per sample) plus the
    PPO pass over the trained (sample, step) rows (~3 forwards each: forward + backward, +1 for the KL
    reference); ``trained_steps`` (default ``steps``) is how many steps per rollout the update trains."""
    trained = steps if trained_steps is None else trained_steps
    return samples * steps + samples * trained * (3 + (1 if kl else 0))


def plan(state: PlannerState, prompts: list[str], *, group_size: int, batch: int, budget_candidates: int,
         max_per_prompt: int, generator: torch.Generator) -> tuple[list[int], list[float]]:
    """Candidates per prompt (multiples of ``batch``, >= group_size, <= max_per_prompt) and, per prompt,
    the gain the plan expects from them under its sampled reward std: sigma * (e(K) - e(G))."""
    floor = -(-group_size // batch) * batch
    cap = max(floor, max_per_prompt // batch * batch)
    counts = [floor] * len(prompts)
    rng = random.Random(int(torch.randint(2**62, (), generator=generator)))  # the stdlib has gamma draws
    # + 1e-6: prompts of (almost) no spread still split the budget evenly (the gain curve's steps shrink)
    sigmas = [state.posteriors.get(p, PromptPosterior()).sample(rng) ** 0.5 + 1e-6 for p in prompts]

    def marginal(i: int) -> float:  # expected gain of prompt i's next batch
        return sigmas[i] * (gain_curve(counts[i] + batch, group_size) - gain_curve(counts[i], group_size))

    extra_batches = max(0, (budget_candidates - sum(counts)) // batch)
    while extra_batches > 0:
        open_ = [i for i, c in enumerate(counts) if c + batch <= cap]
        if not open_:
            break
        i = max(open_, key=marginal)  # first index wins a tie
        counts[i] += batch
        extra_batches -= 1
    return counts, [s * (gain_curve(c, group_size) - gain_curve(group_size, group_size))
                    for s, c in zip(sigmas, counts)]


def exploration_budget(cfg, t: int, prompts: int) -> int:
    """Candidates the exploration pool can roll out while update(t-1) runs, in forward passes
    (``exploration.budget_scale`` x the update's cost); the first iteration, with nothing learned
    and nothing to overlap, explores ``candidates_per_prompt`` per prompt at least."""
    ec, gc = cfg.exploration, cfg.grpo
    update_forwards = update_cost_forwards(gc.prompts_per_iteration * gc.group_size, cfg.sampler.train_steps,
                                           gc.kl_beta > 0, cfg.trained_steps)
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
