"""An exponential moving average of the trained weights (``grpo.ema``), as flow_grpo keeps one.

flow_grpo's SD3 and FLUX recipes evaluate and save an EMA of the LoRA, not the live weights: the average
of the last ~160 optimizer steps samples more smoothly than the weights of the last one. Here the
average is kept over the policy's trainable state (the adapter with LoRA, the transformer otherwise),
committed with it by every update (``ema.safetensors``), so a resumed run continues the same average
bit for bit; evaluation and export swap it in. Rollouts, exploration and the update itself always use
the live weights (the PPO ratio is against the policy that sampled).

flow_grpo calls its ``ema.step`` once per sample batch with the optimizer step count, so where it
accumulates gradients over k sample batches an update of the average is applied k times in a row;
here it is applied once per qualifying optimizer step, as its docstring intends.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from spotlight.checkpoints import EMA
from spotlight.config import EMASection
from spotlight.models.policy import DiffusionPolicy
from spotlight.run import Run


def ema_decay(steps: int, decay: float) -> float:
    """flow_grpo's decay after ``steps`` optimizer steps: a warm-up, min((1 + n) / (10 + n), decay)."""
    return min((1 + steps) / (10 + steps), decay)


class WeightsEMA:
    """The average of a policy's trainable state; ``step()`` after every optimizer step of the run.

    As flow_grpo's ``EMAModuleWrapper.step(parameters, global_step)`` with ``global_step`` the optimizer
    steps taken so far, n: when (n + 1) % every == 0 the average moves towards the weights by
    1 - ema_decay(n). Floating tensors average in fp32 whatever the weights' dtype."""

    def __init__(self, cfg: EMASection, state: dict[str, torch.Tensor], steps_done: int) -> None:
        self.cfg = cfg
        self.average = {k: v.detach().float().clone() if v.is_floating_point() else v.detach().clone()
                        for k, v in state.items()}
        self.steps_done = steps_done  # optimizer steps the run has taken

    def step(self, policy: DiffusionPolicy) -> None:
        """An optimizer step has just been taken."""
        self.steps_done += 1
        n = self.steps_done
        if (n + 1) % self.cfg.every:
            return
        weight = 1.0 - ema_decay(n, self.cfg.decay)
        with torch.no_grad():
            for name, value in policy.trainable_state().items():
                average = self.average[name]
                if average.is_floating_point():
                    average.add_(weight * (value.detach().float() - average))
                else:
                    average.copy_(value)


@contextmanager
def weights_swapped(policy: DiffusionPolicy, state: dict[str, torch.Tensor] | None) -> Iterator[DiffusionPolicy]:
    """``policy`` with ``state`` as its trainable state for the duration, then its own again, exactly
    (None: unchanged)."""
    if state is None:
        yield policy
        return
    own = {k: v.detach().clone() for k, v in policy.trainable_state().items()}
    policy.load_trainable_state(state)
    try:
        yield policy
    finally:
        policy.load_trainable_state(own)


def ema_state(run: Run, t: int) -> dict[str, torch.Tensor] | None:
    """theta_t's EMA, which evaluation and export use in place of theta_t's weights; None when ``grpo.ema``
    is off, or for theta_0 (whose average is itself)."""
    if run.cfg.grpo.ema is None or t == 0:
        return None
    return run.store.load(run.key("update", t - 1)).tensors(EMA)
