"""The GRPO step of Flow-GRPO: group-relative advantages and a PPO-clipped update over (sample, timestep) rows."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Literal

import torch

from spotlight.models.policy import Policy, PromptEmbeds
from spotlight.sampler import Rollout, SDEStep, step_log_prob

if TYPE_CHECKING:
    from spotlight.config.recipe import GRPOSection


def group_advantages(rewards: torch.Tensor, std: Literal["per_prompt", "global"] = "per_prompt",
                     clip: float = 5.0, eps: float = 1e-4, negative_weight: float = 1.0,
                     std_floor: float = 0.0) -> torch.Tensor:
    """``rewards`` [P, G] -> advantages [P, G]: centred per prompt, scaled by the per-prompt or global std.

    A group whose rewards are all equal gets zero advantage: it teaches nothing, which is why
    exploration hunts for high-variance groups. ``negative_weight`` scales the below-average samples'
    advantages (1: Flow-GRPO; 0: only the better samples of a group are reinforced, none pushed away).
    ``std_floor`` is the least std a group is divided by: a solved prompt whose rewards differ by
    0.001 then gets advantages of ~0.001 / floor instead of +-1, so the policy is not pushed towards
    whichever of its near-perfect samples the reward happens to rank first (0: Flow-GRPO).
    """
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    scale = rewards.std(dim=1, keepdim=True) if std == "per_prompt" else rewards.std()
    scale = scale.clamp(min=std_floor)
    advantages = (centred / (scale + eps)).clamp(-clip, clip)
    return torch.where(advantages < 0, advantages * negative_weight, advantages)


def recipe_advantages(rewards: torch.Tensor, gc: GRPOSection) -> torch.Tensor:
    """``group_advantages`` with the config's recipe, [P, G] -> [P * G]: the update and
    ``bench/real_scale.py`` both take it, so an option of ``grpo`` cannot reach one and miss the other."""
    return group_advantages(rewards, gc.adv_std, gc.adv_clip, negative_weight=gc.negative_advantage_weight,
                            std_floor=gc.adv_std_floor).flatten()


def clipped_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                        clip_range: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's pessimistic clipped surrogate, per row."""
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        stats = {
            "clip_frac": ((ratio - 1).abs() > clip_range).float().mean().item(),
            "approx_kl": (0.5 * log_ratio**2).mean().item(),
            "max_abs_log_ratio": log_ratio.abs().max().item(),
            "mean_abs_log_ratio": log_ratio.abs().mean().item(),
        }
    return loss, stats


def step_kl(step: SDEStep, ref_step: SDEStep, exact: bool = False) -> torch.Tensor:
    """flow_grpo's KL of a step to the reference's, per row [B]: the mean over latent dimensions of
    ``(mean - mean_ref)**2``, divided by ``2 * std_t**2`` (``std_t``: the SDE's diffusion coefficient at
    the step's sigma, flow_grpo's ``std_dev_t``; no ``dt``).

    The exact KL between the two Gaussian steps, N(mean, std_t**2 |dt| I) and N(mean_ref, same), per
    latent dimension is ``(mean - mean_ref)**2 / (2 * std_t**2 * |dt|)``: this term is that times ``|dt|``
    (the step's width in sigma). Dividing by the step's own variance instead, as the exact KL does, makes
    the same ``kl_beta`` 1/|dt| times stronger: 3.7-25x on a 10-step shift-3 schedule. ``exact`` gives that
    form, whose sum over the steps is the KL of the whole trajectory to the reference's.
    """
    scale = (step.std if exact else step.std_t).flatten()
    return ((step.mean - ref_step.mean) ** 2).mean(dim=tuple(range(1, step.mean.ndim))) / (2 * scale**2)


@dataclass
class UpdateBatch:
    """Flattened rollouts: row (i, k) is sample i's transition at step k."""

    rollout: Rollout
    cond: PromptEmbeds
    uncond: PromptEmbeds | None
    advantages: torch.Tensor  # [B]
    sigmas: torch.Tensor


def grpo_epoch(policy: Policy, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               batch: UpdateBatch, *, optimizer_steps: int, clip_range: float, noise_level: float,
               guidance: float, max_grad_norm: float, kl_beta: float = 0.0, kl_exact: bool = False,
               kl_reference: Callable[[], ContextManager[Policy]] | None = None, microbatch_size: int | None = None,
               trained_steps: int | None = None, generator: torch.Generator, rank: int = 0, world: int = 1,
               after_step: Callable[[], None] | None = None) -> list[dict[str, float]]:
    """One pass over the (sample, timestep) rows in a seeded shuffled order, in ``optimizer_steps``
    minibatches of equal size (rows / steps, the first ``rows % steps`` one row larger): the steps per
    iteration are what a recipe states (flow_grpo: two), whatever the rows come to.

    ``trained_steps``: only each rollout's first that many steps are trained (flow_grpo's
    ``timestep_fraction``; default all). The rollout's later steps were sampled and scored all the same.

    A minibatch is computed in microbatches of ``microbatch_size`` rows (gradient accumulation: a real
    DiT cannot take hundreds of 512 px rows in one pass); the step is that of the whole minibatch.
    Data parallel (``world`` > 1, the policy wrapped in DDP): every rank holds the same rollouts and
    draws the same order, takes rows ``rank::world`` of each minibatch and scales its loss so the
    gradient DDP averages is exactly the gradient of the whole minibatch's mean loss.

    ``kl_beta`` > 0 adds the KL to the reference policy (``policy.reference()``: with LoRA the same
    weights with the adapter disabled) exactly as flow_grpo does (``_rows_loss``), so a ``kl_beta``
    means what it means there. ``kl_reference`` replaces that reference (``grpo.kl_reference: ema``: the
    EMA's average swapped in). ``after_step`` runs after every optimizer step (the EMA's update).
    """
    ro = batch.rollout
    n, total_steps = ro.log_probs.shape
    steps = total_steps if trained_steps is None else trained_steps
    if not 1 <= steps <= total_steps:
        raise ValueError(f"trained_steps must be in [1, {total_steps}], got {trained_steps}")
    if not 1 <= optimizer_steps <= n * steps:
        raise ValueError(f"optimizer_steps must be in [1, {n * steps}] (the rows trained), got {optimizer_steps}")
    rows = torch.randperm(n * steps, generator=generator)
    stats = []
    for whole in rows.tensor_split(optimizer_steps):
        sel = whole[rank::world].to(ro.latents.device)  # the order is drawn on the CPU on every device
        share = len(sel) * world / len(whole)  # 1.0 exactly in a single process
        optimizer.zero_grad(set_to_none=True)
        chunks = sel.split(microbatch_size or len(sel))
        parts = []
        for c, chunk in enumerate(chunks):
            last = c == len(chunks) - 1
            sync = nullcontext() if last or not hasattr(policy.transformer, "no_sync") else policy.transformer.no_sync()
            with sync:  # DDP all-reduces once per minibatch, on its last microbatch
                loss, st = _rows_loss(policy, batch, chunk, steps, clip_range, noise_level, guidance, kl_beta,
                                      kl_exact, kl_reference or policy.reference)
                (loss * share * len(chunk) / len(sel)).backward()
            parts.append((len(chunk), loss.item(), st))
        st = {key: sum(w * p[key] for w, _, p in parts) / len(sel) for key in parts[0][2] if key != "max_abs_log_ratio"}
        st["max_abs_log_ratio"] = max(p["max_abs_log_ratio"] for _, _, p in parts)
        st["grad_norm"] = torch.nn.utils.clip_grad_norm_(params, max_grad_norm).item()
        optimizer.step()
        if after_step is not None:
            after_step()
        st["loss"] = sum(w * value for w, value, _ in parts) / len(sel)
        st["rows"], st["minibatch_rows"] = len(sel), len(whole)  # this rank's, and all ranks'
        stats.append(st)
    return stats


def _rows_loss(policy: Policy, batch: UpdateBatch, sel: torch.Tensor, steps: int, clip_range: float,
               noise_level: float, guidance: float, kl_beta: float, kl_exact: bool,
               kl_reference: Callable[[], ContextManager[Policy]]) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean clipped loss (+ KL) of rows ``sel`` (sample * steps + step), and its statistics. The
    reference's pass comes first: a reference that swaps weights into the trained module must not do so
    while this pass's graph holds them."""
    ro = batch.rollout
    i, k = sel // steps, sel % steps
    x, x_next = ro.latents[i, k], ro.latents[i, k + 1]
    uncond = batch.uncond[i] if batch.uncond is not None else None
    if kl_beta > 0:
        with torch.no_grad(), kl_reference() as reference:
            _, ref_step = step_log_prob(reference, x, x_next, k, batch.cond[i], uncond, batch.sigmas,
                                        noise_level, guidance)
    log_prob, step = step_log_prob(policy, x, x_next, k, batch.cond[i], uncond, batch.sigmas, noise_level, guidance)
    loss, st = clipped_policy_loss(log_prob, ro.log_probs[i, k], batch.advantages[i], clip_range)
    if kl_beta > 0:
        kl = step_kl(step, ref_step, kl_exact)
        loss = loss + kl_beta * kl.mean()
        st["kl_ref"] = kl.mean().item()
    return loss, st
