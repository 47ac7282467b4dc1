"""One iteration's work at the real config, and the seconds it takes on the workers' GPUs.

Work is counted the way the exploration planner counts it (:mod:`spotlight.planner`), in forward-pass
equivalents of the transformer: an update is ``update_cost_forwards`` (its rollouts plus ~3 per trained
row, +1 with a KL reference), a candidate seed costs ``exploration_steps`` forwards, an evaluation
``eval prompts x seeds x eval_steps``. CFG doubles every one of them alike, so it cancels. What the
count leaves out: VAE decodes, reward scoring and text encoding (a few % of a 10-step DiT rollout).

Seconds: one stated number, the trainer's seconds per update at the config's batch on its GPU, fixes
the seconds of a forward; an explorer on another GPU takes them in the ratio of the two GPUs' dense
bf16 throughput (datasheet figures below), printed as an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spotlight.catalog import parse_accelerator_spec
from spotlight.config import Config
from spotlight.forecast.errors import ForecastError
from spotlight.planner import PlannerState, exploration_budget, plan, update_cost_forwards

#: dense (no sparsity) bf16 tensor TFLOPS per GPU, NVIDIA datasheets; only the ratio of two is used, and only
#: when the trainer and the explorers get different GPUs (T4: fp16, it has no bf16)
DENSE_BF16_TFLOPS = {"T4": 65.0, "L4": 121.0, "L40S": 362.0, "A100": 312.0, "A100-80GB": 312.0, "H100": 989.0,
                     "H200": 989.0, "B200": 2250.0}


@dataclass(frozen=True)
class IterationWork:
    """An iteration's work in forward-pass equivalents, and how the exploration is cut into queue work."""

    update_forwards: int
    evaluate_forwards: int  # one evaluation of the held-out set (0: its size is unknown here)
    evaluate_every: int
    explore_steps: int  # forwards per candidate
    seeds_per_batch: int  # a unit: one seed batch of one prompt
    candidates: tuple[int, ...]  # per explored prompt (an item), iterations >= 1
    first_candidates: tuple[int, ...]  # explore(0), before the planner has learned anything
    group_size: int

    @property
    def explore_forwards(self) -> int:
        return sum(self.candidates) * self.explore_steps

    @property
    def width(self) -> float:
        """Mean candidates per explored prompt."""
        return sum(self.candidates) / max(len(self.candidates), 1)

    def items(self, seconds_per_forward: float, first: bool = False) -> list[list[float]]:
        """The exploration queue in explorer-seconds: per item (prompt), each unit's (seed batch's) seconds."""
        per_unit = self.seeds_per_batch * self.explore_steps * seconds_per_forward
        counts = self.first_candidates if first else self.candidates
        return [[min(per_unit, (n - b) * self.explore_steps * seconds_per_forward)
                 for b in range(0, n, self.seeds_per_batch)] for n in counts]


def iteration_work(cfg: Config, width: int | None = None) -> IterationWork:
    """The config's iteration, as its planner sizes it (an iteration with nothing learned yet: Thompson
    draws from the prior), or with every explored prompt given ``width`` candidates (the width lever)."""
    gc, ec = cfg.grpo, cfg.exploration
    update = update_cost_forwards(gc.prompts_per_iteration * gc.group_size, cfg.sampler.train_steps, gc.kl_beta > 0,
                                  cfg.trained_steps)
    evaluate = (cfg.evaluation.prompts or 0) * cfg.evaluation.seeds_per_prompt * cfg.sampler.eval_steps
    explored = gc.prompts_per_iteration + (ec.extra_prompts if ec.select != "seeds" else 0)
    if ec.mode == "none":
        counts = first = (gc.group_size,) * gc.prompts_per_iteration
    elif width is not None:
        if width < gc.group_size or width % ec.seeds_per_batch:
            raise ForecastError(f"width {width}: candidates per prompt must be >= group_size ({gc.group_size}) "
                                f"and a multiple of exploration.seeds_per_batch ({ec.seeds_per_batch})")
        counts = first = (width,) * explored
    else:
        counts, first = (tuple(_planned(cfg, t, explored)) for t in (1, 0))
    return IterationWork(update, evaluate, cfg.evaluation.every, cfg.exploration_steps, ec.seeds_per_batch,
                         counts, first, gc.group_size)


def _planned(cfg: Config, t: int, prompts: int) -> list[int]:
    counts, _ = plan(PlannerState(), [f"prompt-{i}" for i in range(prompts)], group_size=cfg.grpo.group_size,
                     batch=cfg.exploration.seeds_per_batch, budget_candidates=exploration_budget(cfg, t, prompts),
                     max_per_prompt=cfg.exploration.max_candidates_per_prompt,
                     generator=torch.Generator().manual_seed(cfg.run.seed))
    return counts


def relative_seconds(explorer: str, trainer: str) -> float:
    """A trainer's seconds per explorer-second of exploration work: 1 on the same GPU, else the ratio of
    their dense bf16 throughput."""
    e, _ = parse_accelerator_spec(explorer)
    t, _ = parse_accelerator_spec(trainer)
    if e == t:
        return 1.0
    missing = [n for n in (e, t) if n not in DENSE_BF16_TFLOPS]
    if missing:
        raise ForecastError(f"no throughput figure for {', '.join(missing)} (known: {', '.join(DENSE_BF16_TFLOPS)}): "
                            "the forecast cannot say how fast it explores next to the other worker's GPU")
    return DENSE_BF16_TFLOPS[e] / DENSE_BF16_TFLOPS[t]
