"""Flow-GRPO's SDE sampler with exact per-step Gaussian log-probs, and an ODE sampler for evaluation.

Rectified flow (SD3 convention): ``x_sigma = (1 - sigma) x0 + sigma * noise``, the model predicts
``v = noise - x0``, sigma runs 1 -> 0. Flow-GRPO turns the probability-flow ODE into an SDE with the
same marginals, ``std_t = a * sqrt(sigma / (1 - sigma))``, so each step is a Gaussian whose log-density
is exact. As in flow_grpo, a step's log-prob is the mean over latent dimensions of that density.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from spotlight.models.policy import Policy, PromptEmbeds
from spotlight.seeding import draw, rollout_generators

LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def encode_conditioning(policy: Policy, prompts: Sequence[str], guidance: float,
                        negative_prompt: str = "") -> tuple[PromptEmbeds, PromptEmbeds | None]:
    """The prompts' embeddings, and the negative prompt's when guidance needs an unconditional pass."""
    cond = policy.encode_prompts(list(prompts))
    uncond = policy.encode_prompts([negative_prompt] * len(prompts)) if policy.needs_uncond(guidance) else None
    return cond, uncond


@dataclass
class SDEStep:
    mean: torch.Tensor  # [B, *latent_shape]
    std: torch.Tensor  # [B, 1, ...]: std of x_prev given x, std_t * sqrt(|dt|)
    std_t: torch.Tensor  # [B, 1, ...]: the SDE's diffusion coefficient at sigma (flow_grpo's std_dev_t)

    def log_prob(self, x_prev: torch.Tensor) -> torch.Tensor:
        """Exact Gaussian log-density of ``x_prev`` (fp32), averaged over latent dimensions: [B]."""
        lp = -((x_prev.float() - self.mean.float()) ** 2) / (2 * self.std**2) - torch.log(self.std) - LOG_SQRT_2PI
        return lp.mean(dim=tuple(range(1, lp.ndim)))


def sde_step(v: torch.Tensor, x: torch.Tensor, step_idx: torch.Tensor, sigmas: torch.Tensor,
             noise_level: float) -> SDEStep:
    """Flow-GRPO's step k: sigma_k -> sigma_{k+1}, per row (rows may be at different steps)."""
    view = (-1, *([1] * (x.ndim - 1)))
    sigma, sigma_prev = sigmas[step_idx].view(view), sigmas[step_idx + 1].view(view)
    dt = sigma_prev - sigma
    std_t = torch.sqrt(sigma / (1 - torch.where(sigma >= 1.0, sigmas[1], sigma))) * noise_level
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return SDEStep(mean=mean, std=std_t * torch.sqrt(-dt), std_t=std_t)


@dataclass
class Rollout:
    """A batch of SDE trajectories: latents[:, k] -> latents[:, k+1] is step k, with its log-prob."""

    prompts: list[str]
    seeds: list[int]
    latents: torch.Tensor  # [B, steps + 1, *latent_shape]
    log_probs: torch.Tensor  # [B, steps]
    images: torch.Tensor  # [B, *image_shape] decoded final samples

    @staticmethod
    def cat(parts: Sequence["Rollout"]) -> "Rollout":
        return Rollout([p for r in parts for p in r.prompts], [s for r in parts for s in r.seeds],
                       torch.cat([r.latents for r in parts]), torch.cat([r.log_probs for r in parts]),
                       torch.cat([r.images for r in parts]))


def brownian_noise(gens: list[torch.Generator], shape: tuple[int, ...], device: torch.device,
                   fine_sigmas: torch.Tensor) -> torch.Tensor:
    """Standard-normal noise of one step spanning the fine levels ``fine_sigmas``: the normalised sum
    of the fine steps' Brownian increments (exactly the plain draw when the step is not coarsened)."""
    if len(fine_sigmas) == 2:
        return draw(gens, shape, device)
    dts = fine_sigmas[:-1] - fine_sigmas[1:]
    increments = sum(dt.sqrt() * draw(gens, shape, device) for dt in dts)
    return increments / dts.sum().sqrt()


@torch.no_grad()
def sample_sde(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], steps: int,
               noise_level: float, guidance: float = 1.0, brownian_steps: int | None = None,
               negative_prompt: str = "") -> Rollout:
    """SDE rollouts; seed i's generator draws rollout i's initial latent and every step noise.

    ``brownian_steps`` (a multiple of ``steps``; default ``steps``) is the grid the seed's noise is
    drawn on. A coarser rollout sums each span's fine increments, sqrt(dt_j) eps_j, into one step's
    noise: it follows the *same* Brownian path as the fine rollout of that seed, only discretised
    more coarsely, so the cheap rollout's reward ranks seeds almost as the fine one does (freshly
    drawn coarse noise would be another rollout altogether; docs/exploration.md has the numbers).
    """
    fine_steps = brownian_steps or steps
    if fine_steps % steps:
        raise ValueError(f"brownian_steps ({fine_steps}) must be a multiple of steps ({steps})")
    span = fine_steps // steps
    gens = rollout_generators(list(seeds))
    fine_sigmas = policy.sigmas(fine_steps).to(policy.device)
    sigmas = fine_sigmas[::span]  # the coarse schedule is every span-th level of the fine one
    cond, uncond = encode_conditioning(policy, prompts, guidance, negative_prompt)
    x = draw(gens, policy.latent_shape, policy.device)
    latents, log_probs = [x], []
    for k in range(steps):
        step_idx = torch.full((len(seeds),), k, device=policy.device)
        v = policy.guided_velocity(x, sigmas[step_idx], cond, uncond, guidance)
        step = sde_step(v, x, step_idx, sigmas, noise_level)
        x = step.mean + step.std * brownian_noise(gens, policy.latent_shape, policy.device,
                                                  fine_sigmas[k * span:(k + 1) * span + 1])
        latents.append(x)
        log_probs.append(step.log_prob(x))
    return Rollout(list(prompts), [int(s) for s in seeds], torch.stack(latents, 1),
                   torch.stack(log_probs, 1), policy.decode(x))


def step_log_prob(policy: Policy, latents: torch.Tensor, next_latents: torch.Tensor, step_idx: torch.Tensor,
                  cond: PromptEmbeds, uncond: PromptEmbeds | None, sigmas: torch.Tensor, noise_level: float,
                  guidance: float = 1.0) -> tuple[torch.Tensor, SDEStep]:
    """Re-evaluate, with gradients, the log-prob of stored transitions (rows may mix timesteps)."""
    v = policy.guided_velocity(latents, sigmas[step_idx], cond, uncond, guidance)
    step = sde_step(v, latents, step_idx, sigmas, noise_level)
    return step.log_prob(next_latents), step


@torch.no_grad()
def sample_ode(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], steps: int,
               guidance: float = 1.0, negative_prompt: str = "", decode: bool = True) -> torch.Tensor:
    """Deterministic Euler sampling of the probability-flow ODE (evaluation, and what diffusers'
    pipelines do with the same schedule): decoded images, or the final latents (``decode=False``)."""
    gens = rollout_generators(list(seeds))
    sigmas = policy.sigmas(steps).to(policy.device)
    cond, uncond = encode_conditioning(policy, prompts, guidance, negative_prompt)
    x = draw(gens, policy.latent_shape, policy.device)
    for k in range(steps):
        v = policy.guided_velocity(x, sigmas[k].expand(len(x)), cond, uncond, guidance)
        x = x + (sigmas[k + 1] - sigmas[k]) * v
    return policy.decode(x) if decode else x


def sample_sde_batched(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], batch_size: int | None,
                       **kwargs) -> Rollout:
    """:func:`sample_sde` in batches of ``batch_size`` rollouts (None: one batch): a real DiT cannot
    roll out a whole update's samples at once. The same batching always gives the same bits."""
    size = batch_size or len(seeds)
    return Rollout.cat([sample_sde(policy, prompts[i:i + size], seeds[i:i + size], **kwargs)
                        for i in range(0, len(seeds), size)])


def sample_ode_batched(policy: Policy, prompts: Sequence[str], seeds: Sequence[int], batch_size: int | None,
                       **kwargs) -> torch.Tensor:
    """:func:`sample_ode` in batches of ``batch_size`` samples (None: one batch)."""
    size = batch_size or len(seeds)
    return torch.cat([sample_ode(policy, prompts[i:i + size], seeds[i:i + size], **kwargs)
                      for i in range(0, len(seeds), size)])
