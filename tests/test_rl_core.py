"""The RL core: reproducible rollouts, exact SDE log-probs, group advantages, the PPO-clipped step."""

from __future__ import annotations

import math

import pytest
import torch

from spotlight.config import Config, TinyModelSection
from spotlight.grpo import UpdateBatch, clipped_policy_loss, group_advantages, grpo_epoch
from spotlight.models.policy import build_policy
from spotlight.models.tiny import shifted_sigmas as sigma_schedule
from spotlight.sampler import sample_sde, sde_step

PROMPTS = ["a handwritten digit 3", "a handwritten digit 7"]


def tiny_policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_policy(Config(model=TinyModelSection(num_layers=1))).eval()


def update_batch(policy, samples: int, steps: int, advantages: torch.Tensor) -> UpdateBatch:
    """SDE rollouts of PROMPTS (repeated to ``samples``, seeds 0..samples-1) as an update batch."""
    prompts, seeds = PROMPTS * (samples // len(PROMPTS)), list(range(samples))
    rollout = sample_sde(policy, prompts, seeds, steps=steps, noise_level=0.7)
    return UpdateBatch(rollout, policy.encode_prompts(prompts), None, advantages, sigma_schedule(steps, 3.0))


def test_policy_is_a_small_sd3_mmdit():
    from diffusers import SD3Transformer2DModel

    policy = build_policy(Config())
    assert isinstance(policy.transformer, SD3Transformer2DModel)
    assert 1e6 < sum(p.numel() for p in policy.transformer.parameters()) < 3e6


def test_seed_fixes_the_whole_rollout_bit_for_bit():
    policy = tiny_policy()
    a = sample_sde(policy, PROMPTS, [5, 9], steps=4, noise_level=0.7)
    b = sample_sde(policy, PROMPTS, [5, 9], steps=4, noise_level=0.7)
    c = sample_sde(policy, PROMPTS, [5, 10], steps=4, noise_level=0.7)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
    assert torch.equal(a.latents[0], c.latents[0]) and not torch.equal(a.latents[1, 1:], c.latents[1, 1:])


def test_rollouts_compute_on_the_policy_device_with_cpu_drawn_noise():
    """The meta device stands in for a GPU here: mixing it with a CPU tensor fails as cuda would."""
    from spotlight.sampler import sample_ode
    from spotlight.seeding import draw, rollout_generators

    policy = tiny_policy().to("meta")
    ro = sample_sde(policy, PROMPTS, [5, 9], steps=3, noise_level=0.7)
    assert {ro.latents.device.type, ro.log_probs.device.type, ro.images.device.type} == {"meta"}
    assert sample_ode(policy, PROMPTS, [5, 9], steps=3).device.type == "meta"
    # the draw is made by the CPU generators and only then moved: they advance exactly as on the CPU,
    # so a seed names the same noise stream on every device
    on_meta, on_cpu = rollout_generators([5, 9]), rollout_generators([5, 9])
    assert draw(on_meta, (1, 4, 4), "meta").device.type == "meta"
    draw(on_cpu, (1, 4, 4))
    assert torch.equal(draw(on_meta, (1, 4, 4)), draw(on_cpu, (1, 4, 4)))


def test_coarse_rollout_follows_the_fine_rollouts_brownian_path():
    """A 3-step rollout on a 6-step noise grid: each coarse increment is the sum of two fine ones."""
    from spotlight.sampler import brownian_noise
    from spotlight.seeding import draw, rollout_generators

    fine = sigma_schedule(6, 3.0)
    coarse, plain = rollout_generators([5, 9]), rollout_generators([5, 9])
    for k in range(3):
        span = fine[2 * k:2 * k + 3]
        dt = span[:-1] - span[1:]
        summed = dt[0].sqrt() * draw(plain, (1, 4, 4)) + dt[1].sqrt() * draw(plain, (1, 4, 4))
        torch.testing.assert_close(dt.sum().sqrt() * brownian_noise(coarse, (1, 4, 4), "cpu", span), summed)
    # not coarsened: exactly the plain draw, so full-step rollouts keep their bits
    assert torch.equal(brownian_noise(rollout_generators([5]), (1, 4, 4), "cpu", fine[:2]),
                       draw(rollout_generators([5]), (1, 4, 4)))


def test_coupled_coarse_rollouts_rank_seeds_like_the_fine_ones():
    from spotlight.exploration import spearman

    policy, prompts, seeds = tiny_policy(), ["a handwritten digit 3"] * 64, list(range(64))
    def score(ro):
        return ro.images.mean(dim=(1, 2, 3)).tolist()
    fine = score(sample_sde(policy, prompts, seeds, steps=6, noise_level=0.7))
    coupled = score(sample_sde(policy, prompts, seeds, steps=3, noise_level=0.7, brownian_steps=6))
    fresh = score(sample_sde(policy, prompts, seeds, steps=3, noise_level=0.7))
    assert spearman(fine, coupled) > spearman(fine, fresh) + 0.1
    with pytest.raises(ValueError, match=r"brownian_steps \(6\) must be a multiple of steps \(4\)"):
        sample_sde(policy, prompts[:1], seeds[:1], steps=4, noise_level=0.7, brownian_steps=6)


def test_sde_step_log_prob_is_the_exact_gaussian_density():
    sigmas = sigma_schedule(5, 3.0)
    x, v = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    step = sde_step(v, x, torch.tensor([0, 2, 4]), sigmas, noise_level=0.7)
    x_prev = step.mean + step.std * torch.randn_like(x)
    exact = torch.distributions.Normal(step.mean, step.std.expand_as(step.mean)).log_prob(x_prev).mean(dim=(1, 2, 3))
    torch.testing.assert_close(step.log_prob(x_prev), exact, rtol=1e-6, atol=1e-6)
    # the noise std follows Flow-GRPO: a * sqrt(sigma / (1 - sigma)) * sqrt(-dt)
    k = 2
    s, sp = sigmas[k].item(), sigmas[k + 1].item()
    assert math.isclose(step.std[1].item(), 0.7 * math.sqrt(s / (1 - s)) * math.sqrt(s - sp), rel_tol=1e-5)


def test_group_advantages():
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 10.0]])
    adv = group_advantages(rewards, "per_prompt", clip=1.2)
    assert torch.equal(adv[0], torch.zeros(4)), "a zero-variance group teaches nothing"
    torch.testing.assert_close(adv[1], torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.5 / (rewards[1].std() + 1e-4))
    assert adv.abs().max() <= 1.2 + 1e-6, "advantages are clamped"
    glob = group_advantages(rewards, "global", clip=100)
    torch.testing.assert_close(glob[2, 3], (10 - 2.5) / (rewards.std() + 1e-4))
    # grpo.negative_advantage_weight: the below-average samples' advantages scaled, the better ones as they were
    for weight in (0.0, 0.3):
        scaled = group_advantages(rewards, "per_prompt", clip=1.2, negative_weight=weight)
        torch.testing.assert_close(scaled, torch.where(adv < 0, weight * adv, adv))
        assert (scaled >= 0).all() if weight == 0 else (scaled < 0).any()
    # grpo.adv_std_floor: a nearly solved group (std 0.001) is divided by the floor, a spread-out one by its std
    solved = torch.tensor([[0.998, 0.999, 0.999, 1.0], [0.0, 1.0, 0.0, 1.0]])
    floored = group_advantages(solved, "per_prompt", clip=5.0, std_floor=0.05)
    torch.testing.assert_close(floored[0], (solved[0] - solved[0].mean()) / (0.05 + 1e-4))
    assert floored[0].abs().max() < 0.03 < group_advantages(solved, "per_prompt")[0].abs().max()
    torch.testing.assert_close(floored[1], group_advantages(solved, "per_prompt")[1])


def test_clipped_loss_is_pessimistic():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2)
    new = torch.log(torch.tensor([1.5, 0.5]))  # ratios 1.5 and 0.5, clip range 0.2
    loss, stats = clipped_policy_loss(new, old, adv, 0.2)
    # row 0: min(1.5, 1.2) * 1 -> -1.2 ; row 1: -(-1) * max(0.5, 0.8) -> 0.8
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8) / 2))
    assert stats["clip_frac"] == 1.0


def test_first_on_policy_log_ratio_is_zero_and_update_moves_policy():
    policy = tiny_policy()
    prompts, seeds = PROMPTS * 4, list(range(8))
    rollout = sample_sde(policy, prompts, seeds, steps=4, noise_level=0.7)
    rewards = torch.arange(8, dtype=torch.float32).view(2, 4)
    adv = group_advantages(rewards).flatten()
    before = {k: v.clone() for k, v in policy.trainable_state().items()}
    params = list(policy.transformer.parameters())
    batch = UpdateBatch(rollout, policy.encode_prompts(prompts), None, adv, sigma_schedule(4, 3.0))
    stats = grpo_epoch(policy, params, torch.optim.AdamW(params, lr=1e-3), batch, optimizer_steps=4, clip_range=0.2,
                       noise_level=0.7, guidance=1.0, max_grad_norm=1.0, generator=torch.Generator().manual_seed(0))
    assert len(stats) == 4 and all(s["rows"] == 8 for s in stats)  # 8 samples x 4 steps = 32 rows, 4 steps of 8
    assert stats[0]["max_abs_log_ratio"] < 1e-5, "re-evaluated log-probs must match the sampler's on-policy"
    assert stats[-1]["max_abs_log_ratio"] > 1e-6, "after optimizer steps the policy has moved"
    assert any(not torch.equal(before[k], v) for k, v in policy.trainable_state().items())


def test_jpeg_compressibility_prefers_simple_images():
    from spotlight.rewards import JpegCompressibility

    flat = -torch.ones(1, 1, 16, 16)
    noisy = torch.rand(1, 1, 16, 16, generator=torch.Generator().manual_seed(0)) * 2 - 1
    rewards = JpegCompressibility()(torch.cat([flat, noisy]), ["a handwritten digit 1"] * 2)
    assert rewards.shape == (2,) and rewards[0] > rewards[1] and (rewards < 0).all()


def test_classifier_reward_is_probability_of_the_prompted_digit():
    from spotlight.models.classifier import DigitClassifier
    from spotlight.rewards import ClassifierReward

    torch.manual_seed(0)
    model = DigitClassifier(width=4).eval()
    images = torch.rand(3, 1, 16, 16) * 2 - 1
    prompts = ["a handwritten digit 0", "a handwritten digit 5", "a handwritten digit 9"]
    rewards = ClassifierReward("digit_classifier", model, model)(images, prompts)
    probs = model(images)
    torch.testing.assert_close(rewards, probs[torch.arange(3), torch.tensor([0, 5, 9])])


def test_data_parallel_ranks_split_each_minibatch():
    policy = tiny_policy()
    batch = update_batch(policy, 4, 3, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    params = list(policy.transformer.parameters())
    stats = grpo_epoch(policy, params, torch.optim.SGD(params, lr=0.0), batch, optimizer_steps=3, clip_range=0.2,
                       noise_level=0.7, guidance=1.0, max_grad_norm=1.0, generator=torch.Generator().manual_seed(0),
                       rank=1, world=2)
    # 12 rows in 3 steps: minibatches of 4; rank 1 takes every 2nd row of each
    assert [s["rows"] for s in stats] == [2, 2, 2] and [s["minibatch_rows"] for s in stats] == [4, 4, 4]


def test_microbatches_accumulate_the_minibatch_step():
    """A minibatch computed in microbatches (gradient accumulation) takes the same step as in one pass."""
    def epoch(microbatch):
        policy = tiny_policy()
        batch = update_batch(policy, 8, 4, group_advantages(torch.arange(8.0).view(2, 4)).flatten())
        params = list(policy.transformer.parameters())
        stats = grpo_epoch(policy, params, torch.optim.SGD(params, lr=1e-2), batch, optimizer_steps=2,
                           microbatch_size=microbatch, clip_range=0.2, noise_level=0.7, guidance=1.0,
                           max_grad_norm=100.0, generator=torch.Generator().manual_seed(0))
        return policy.trainable_state(), stats
    whole, whole_stats = epoch(None)
    split, split_stats = epoch(5)  # 16 rows as 5 + 5 + 5 + 1
    for key in whole:
        torch.testing.assert_close(split[key], whole[key], rtol=1e-4, atol=1e-6)
    assert [s["rows"] for s in split_stats] == [16, 16]
    assert split_stats[0]["loss"] == pytest.approx(whole_stats[0]["loss"], rel=1e-5)
    assert split_stats[1]["grad_norm"] == pytest.approx(whole_stats[1]["grad_norm"], rel=1e-4)


def test_batched_rollouts_are_the_same_rollouts():
    from spotlight.sampler import sample_sde_batched

    policy = tiny_policy()
    prompts, seeds = PROMPTS * 3, list(range(6))
    whole = sample_sde(policy, prompts, seeds, steps=3, noise_level=0.7)
    parts = sample_sde_batched(policy, prompts, seeds, 4, steps=3, noise_level=0.7)
    assert parts.seeds == whole.seeds and parts.latents.shape == whole.latents.shape
    torch.testing.assert_close(parts.latents, whole.latents, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(parts.log_probs, whole.log_probs, rtol=1e-5, atol=1e-5)


def test_tiny_sigmas_are_sd3_scheduler_sigmas():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    assert torch.equal(tiny_policy().sigmas(10), scheduler.sigmas)
    assert sigma_schedule(10, 3.0)[-2] < 0.01  # the last SDE step starts near 0: it adds almost no noise


def test_timestep_fraction_trains_only_the_first_steps():
    assert Config().trained_steps == 9  # flow_grpo: int(10 * 0.99)
    policy = tiny_policy()
    batch = update_batch(policy, 4, 4, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    params = list(policy.transformer.parameters())
    seen = []
    original = policy.velocity
    policy.velocity = lambda latents, sigma, *a, **k: seen.append(sigma.clone()) or original(latents, sigma, *a, **k)
    stats = grpo_epoch(policy, params, torch.optim.SGD(params, lr=0.0), batch, optimizer_steps=4, clip_range=0.2,
                       noise_level=0.7, guidance=1.0, max_grad_norm=1.0, trained_steps=3,
                       generator=torch.Generator().manual_seed(0))
    assert sum(s["rows"] for s in stats) == 4 * 3  # 4 samples x their first 3 of 4 steps
    assert set(torch.cat(seen).tolist()) == set(sigma_schedule(4, 3.0)[:3].tolist())


def test_ema_is_flow_grpos_and_resumes_from_its_commit_bit_for_bit():
    """``grpo.ema`` against flow_grpo's EMAModuleWrapper written out (flow_grpo/ema.py, called as
    ``ema.step(params, global_step)`` after each optimizer step): when (n + 1) % every == 0, with n the
    optimizer steps taken, the average moves by 1 - min((1 + n) / (10 + n), decay). Restarted from its
    committed bytes mid-run (a resumed update), it continues to the same bits."""
    from spotlight.config import EMASection
    from spotlight.ema import WeightsEMA
    from spotlight.store import bytes_to_tensors, tensors_to_bytes

    policy = tiny_policy()
    cfg = EMASection(decay=0.9, every=3)
    params = dict(policy.core.named_parameters())
    ours = WeightsEMA(cfg, policy.trainable_state(), steps_done=0)
    theirs = {name: p.detach().clone() for name, p in params.items()}
    resumed = None
    g = torch.Generator().manual_seed(0)
    for global_step in range(1, 40):
        with torch.no_grad():  # an optimizer step
            for p in params.values():
                p.add_(torch.randn(p.shape, generator=g) * 0.01)
        ours.step(policy)
        if resumed is not None:
            resumed.step(policy)
        if (global_step + 1) % cfg.every == 0:
            one_minus_decay = 1 - min((1 + global_step) / (10 + global_step), cfg.decay)
            for name, p in params.items():
                theirs[name].add_(one_minus_decay * (p - theirs[name]))
        if global_step == 16:  # update(t) commits, a new process resumes from the commit
            resumed = WeightsEMA(cfg, bytes_to_tensors(tensors_to_bytes(ours.average)), steps_done=16)
    for name in params:
        torch.testing.assert_close(ours.average[name], theirs[name], rtol=0, atol=1e-6)
        assert torch.equal(resumed.average[name], ours.average[name])
    moved = max((ours.average[n] - p).abs().max().item() for n, p in params.items())
    assert moved > 1e-3, "the average lags the weights: the check is not vacuous"


def test_update_takes_adamws_decoupled_weight_decay_from_the_config(tmp_path, cache_url):
    """``grpo.weight_decay`` reaches the update's AdamW: one optimizer step from the same theta_0 and
    gradients lands lr * weight_decay * theta_0 away from the step without decay (AdamW's decoupled form)."""
    from spotlight import stages
    from spotlight.config import load_config
    from spotlight.run import open_run
    from tests.conftest import REPO, SMALL

    def theta_1(weight_decay: float) -> dict[str, torch.Tensor]:
        run = open_run(load_config(REPO / "configs/tiny.yaml", [
            *SMALL, "grpo.iterations=1", "grpo.optimizer_steps=1", f"grpo.weight_decay={weight_decay}",
            f"run.cache_url={cache_url}", f"run.url=file://{tmp_path}/wd{weight_decay}"]))
        stages.pretrain(run)
        stages.update(run, 0)
        return run.policy_state(1), run.policy_at(0).trainable_state(), run.cfg.grpo.lr

    plain, theta_0, lr = theta_1(0.0)
    decayed, _, _ = theta_1(0.5)
    moved = [k for k in plain if not torch.equal(plain[k], theta_0[k])]
    assert moved
    for k in moved:
        torch.testing.assert_close(plain[k] - decayed[k], lr * 0.5 * theta_0[k], rtol=1e-3, atol=1e-7)


def test_the_exact_kl_form_is_flow_grpos_over_the_steps_width_and_the_gaussian_kl():
    """``grpo.kl_form: exact`` is the KL between the two Gaussian steps (per latent dimension): flow_grpo's
    term divided by |dt|; checked against torch.distributions on one step of each width."""
    from spotlight.grpo import step_kl

    torch.manual_seed(0)
    sigmas = sigma_schedule(10, 3.0)
    x, v, v_ref = torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4), torch.randn(3, 1, 4, 4)
    for k in (0, 4, 8):
        idx = torch.full((3,), k)
        step, ref = sde_step(v, x, idx, sigmas, 0.7), sde_step(v_ref, x, idx, sigmas, 0.7)
        dt = (sigmas[k] - sigmas[k + 1]).abs()
        exact = step_kl(step, ref, exact=True)
        assert torch.allclose(exact, step_kl(step, ref) / dt, rtol=1e-5)
        gaussian = torch.distributions.kl_divergence(torch.distributions.Normal(step.mean, step.std),
                                                     torch.distributions.Normal(ref.mean, ref.std))
        assert torch.allclose(exact, gaussian.mean(dim=(1, 2, 3)), rtol=1e-4)


def test_the_kl_to_the_ema_is_the_kl_to_a_policy_holding_its_weights():
    """``grpo.kl_reference: ema`` swaps the average into the trained module for the reference's pass: the
    update is the one whose reference is a separate module holding those weights, and the live weights
    are untouched by the swap (the reference's pass comes before the pass whose graph holds them)."""
    from spotlight.config import GRPOSection
    from spotlight.ema import weights_swapped

    with pytest.raises(ValueError, match="kl_reference: ema needs grpo.ema"):
        GRPOSection(kl_reference="ema")
    g = torch.Generator().manual_seed(1)
    anchor = {k: v + 0.02 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
              for k, v in tiny_policy().trainable_state().items()}

    def epoch(swapped: bool):
        policy = tiny_policy()
        batch = update_batch(policy, 4, 3, torch.tensor([1.0, -1.0, 0.5, -0.5]))
        params = list(policy.transformer.parameters())
        if not swapped:
            policy.keep_reference()
            policy._reference.load_state_dict(anchor)
        stats = grpo_epoch(policy, params, torch.optim.SGD(params, lr=1e-2), batch, optimizer_steps=2,
                           clip_range=0.2, noise_level=0.7, guidance=1.0, max_grad_norm=100.0, kl_beta=1.0,
                           kl_reference=(lambda: weights_swapped(policy, anchor)) if swapped else None,
                           generator=torch.Generator().manual_seed(0))
        return policy.trainable_state(), stats
    (swapped, swapped_stats), (separate, separate_stats) = epoch(True), epoch(False)
    assert swapped_stats[0]["kl_ref"] > 1e-4  # the anchor is not the policy: the term is live
    for s, t in zip(swapped_stats, separate_stats):
        assert s["kl_ref"] == pytest.approx(t["kl_ref"], rel=1e-5) and s["loss"] == pytest.approx(t["loss"], rel=1e-5)
    for key in separate:
        torch.testing.assert_close(swapped[key], separate[key], rtol=1e-5, atol=1e-7)
