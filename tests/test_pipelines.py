"""The diffusers-pipeline policies (SD3.5, FLUX.1, Qwen-Image) on tiny random-weight pipelines.

Every pipeline is built offline (spotlight.models.tiny_pipelines), saved, and loaded through the real
``from_pretrained`` path. The contract: the policy samples exactly what the diffusers pipeline
samples for the same initial latents, and what it exports loads back into that pipeline and samples
the same again.

Tolerances (fp32, CPU, measured on this machine): ODE latents within 2.2e-6 of the pipeline's (FLUX-dev:
bit-identical), decoded images within 1e-6 (in [0, 1]), the exported LoRA loaded into the pipeline within
2.1e-6; we assert 1e-5. First log-ratio of a GRPO update: 0 when a minibatch holds the rollout's own
rows, up to 1.2e-7 when it mixes timesteps (FLUX); we assert <= 1e-6.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import json
import shutil
import subprocess
import sys
from pathlib import Path

import diffusers
import pytest
import torch
from diffusers.utils import logging as diffusers_logging
from safetensors import safe_open

from spotlight.config import ConfigError, config_from_dict
from spotlight.grpo import UpdateBatch, grpo_epoch
from spotlight.models.export import export_full, export_lora, pipeline_class
from spotlight.models.flux import pack_latents, unpack_latents
from spotlight.models.policy import build_policy
from spotlight.models.tiny_pipelines import build_tiny_pipeline
from spotlight.sampler import encode_conditioning, sample_ode, sample_sde, step_log_prob
from spotlight.seeding import draw, rollout_generators

diffusers_logging.disable_progress_bar()

KINDS = ["sd3", "flux", "qwen-image"]
GUIDANCE = {"sd3": 4.5, "flux": 3.5, "qwen-image": 4.5}  # true CFG for sd3 / qwen-image, embedded for flux
PROMPTS = ["a red cat", "a photo of a dog"]  # different token counts: Qwen-Image pads one of them
SEEDS = [3, 11]
STEPS = 4
TOL = 1e-5
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}


def make_cfg(kind: str, pretrained: Path, lora: dict | None = LORA, **sampler):
    model = {"kind": kind, "pretrained": str(pretrained), "resolution": 32, "max_sequence_length": 32,
             **({"lora": lora} if lora else {})}
    return config_from_dict({"model": model, "sampler": sampler})


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipelines")
    return {kind: build_tiny_pipeline(kind, root / kind) for kind in KINDS}


def load_pipeline(kind: str, folder: Path):
    return pipeline_class(kind).from_pretrained(folder)


def pipeline_sample(pipe, kind: str, x0: torch.Tensor, guidance: float, output_type: str,
                    prompts: list[str] = PROMPTS, steps: int = STEPS, negative: str = "",
                    max_sequence_length: int = 32) -> torch.Tensor:
    """The diffusers pipeline's own sampling from the initial latents ``x0`` [B, C, h, w]: unpacked
    latents, or images in [0, 1]."""
    size = x0.shape[-1] * pipe.vae_scale_factor
    kw = dict(prompt=prompts, num_inference_steps=steps, height=size, width=size,
              max_sequence_length=max_sequence_length,
              output_type=output_type)
    if kind == "sd3":
        kw.update(guidance_scale=guidance, latents=x0, negative_prompt=[negative] * len(prompts))
    elif kind == "flux":
        kw.update(guidance_scale=guidance, latents=pack_latents(x0))
        if not pipe.transformer.config.guidance_embeds:
            kw.update(true_cfg_scale=guidance, negative_prompt=[negative] * len(prompts))
    else:
        kw.update(true_cfg_scale=guidance, negative_prompt=[negative] * len(prompts), latents=pack_latents(x0))
    out = pipe(**kw).images
    if output_type == "latent" and kind != "sd3":
        out = unpack_latents(out, *x0.shape[-2:])
    return out


def initial_latents(policy) -> torch.Tensor:
    return draw(rollout_generators(SEEDS), policy.latent_shape)


def read_lora(folder: Path) -> tuple[dict, dict]:
    """A diffusers LoRA file's metadata and tensors (as lists: comparable with ==). Not its bytes: the
    safetensors header's metadata map has no fixed key order."""
    with safe_open(folder / "pytorch_lora_weights.safetensors", "pt") as f:
        return f.metadata(), {k: f.get_tensor(k).tolist() for k in f.keys()}


def perturb_lora(policy, seed: int = 0, scale: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.core.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("kind", KINDS)
def test_ode_sampling_equals_the_pipeline(kind, folders):
    policy = build_policy(make_cfg(kind, folders[kind]), "cpu")
    pipe = load_pipeline(kind, folders[kind])
    g = GUIDANCE[kind]
    assert policy.embedded_guidance == (kind == "flux")
    latents = sample_ode(policy, PROMPTS, SEEDS, STEPS, g, decode=False)
    x0 = initial_latents(policy)
    ref = pipeline_sample(pipe, kind, x0, g, "latent")
    assert torch.equal(policy.sigmas(STEPS), pipe.scheduler.sigmas)  # the pipeline's own schedule, final 0 included
    assert (latents - ref).abs().max() < TOL
    images = policy.decode(latents)
    assert images.shape == (2, 3, 32, 32) and images.dtype == torch.float32
    assert ((images * 0.5 + 0.5) - pipeline_sample(pipe, kind, x0, g, "pt")).abs().max() < TOL
    assert (images[0] - images[1]).abs().max() > 1e-2  # the check is not vacuous


def test_sampler_shift_replaces_the_schedule(folders):
    from diffusers import FlowMatchEulerDiscreteScheduler

    policy = build_policy(make_cfg("flux", folders["flux"], lora=None, shift=2.0), "cpu")
    static = FlowMatchEulerDiscreteScheduler(shift=2.0)
    static.set_timesteps(sigmas=torch.linspace(1, 1 / 5, 5).numpy())
    assert torch.equal(policy.sigmas(5), static.sigmas)


@pytest.mark.parametrize("kind", KINDS)
def test_sde_log_probs_and_one_grpo_step(kind, folders):
    policy = build_policy(make_cfg(kind, folders[kind]), "cpu")
    base = build_policy(make_cfg(kind, folders[kind], lora=None), "cpu")
    g, steps, noise = GUIDANCE[kind], 3, 0.7
    rollout = sample_sde(policy, PROMPTS, SEEDS, steps, noise, guidance=g)
    cond, uncond = encode_conditioning(policy, PROMPTS, g)
    assert (uncond is None) == (kind == "flux")
    sigmas = policy.sigmas(steps)
    with torch.no_grad():  # the rollout's own batches, recomputed: the log-ratio is 0
        for k in range(steps):
            lp, _ = step_log_prob(policy, rollout.latents[:, k], rollout.latents[:, k + 1], torch.full((2,), k),
                                  cond, uncond, sigmas, noise, g)
            assert (lp - rollout.log_probs[:, k]).abs().max() <= 1e-6

    x, sigma = rollout.latents[:, 1], sigmas[1].expand(2)
    with torch.no_grad():
        v_base = base.velocity(x, sigma, cond, g)
    before = {k: v.clone() for k, v in policy.core.state_dict().items()}
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = UpdateBatch(rollout=rollout, cond=cond, uncond=uncond, advantages=torch.tensor([1.0, -1.0]), sigmas=sigmas)
    stats = grpo_epoch(policy, params, optimizer, batch, optimizer_steps=2, clip_range=0.2, noise_level=noise,
                       guidance=g, max_grad_norm=1.0, kl_beta=0.1,
                       generator=torch.Generator().manual_seed(0))
    assert stats[0]["max_abs_log_ratio"] <= 1e-6  # first ratio == 1: sampling and training see one policy
    assert stats[0]["kl_ref"] == 0.0 and stats[-1]["kl_ref"] > 0  # adapter starts at the base, then moves

    after = policy.core.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)
    with torch.no_grad():
        with policy.reference() as ref:
            assert torch.equal(ref.velocity(x, sigma, cond, g), v_base)  # adapters off: the base, bit for bit
        assert not torch.allclose(policy.velocity(x, sigma, cond, g), v_base)


def flow_grpo_kl(policy, rollout, cond, uncond, sigmas, noise_level: float, guidance: float) -> torch.Tensor:
    """flow_grpo's KL loss over every (sample, step) of ``rollout``, written out as scripts/train_sd3.py and
    sde_step_with_logprob compute it: per step, CFG velocities of the policy and of the reference (the
    adapter disabled), each step's mean from its own velocity, then
    ``((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t ** 2)``,
    averaged."""
    def cfg_velocity(x, sigma):
        v_text = policy.velocity(x, sigma, cond)
        v_uncond = policy.velocity(x, sigma, uncond)
        return v_uncond + guidance * (v_text - v_uncond)

    sigma_max = sigmas[1].item()
    losses = []
    with torch.no_grad():
        for j in range(rollout.latents.shape[1] - 1):
            sample = rollout.latents[:, j].float()
            sigma = sigmas[j].expand(len(sample)).view(-1, 1, 1, 1)
            sigma_prev = sigmas[j + 1].expand(len(sample)).view(-1, 1, 1, 1)
            dt = sigma_prev - sigma
            std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
            means = []
            for reference in (False, True):
                if reference:
                    policy.core.disable_adapters()
                model_output = cfg_velocity(sample, sigmas[j].expand(len(sample))).float()
                if reference:
                    policy.core.enable_adapters()
                means.append(sample * (1 + std_dev_t**2 / (2 * sigma) * dt)
                             + model_output * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt)
            prev_sample_mean, prev_sample_mean_ref = means
            kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) \
                / (2 * std_dev_t**2)
            losses.append(torch.mean(kl_loss))
    return torch.stack(losses).mean()  # every step has the same number of rows: the mean over all rows


def test_kl_is_flow_grpos_formula_on_a_tiny_sd3_rollout(folders):
    """``grpo.kl_beta`` means what flow_grpo's train.beta means: our ``kl_ref`` (the KL of one optimizer
    step over every row, learning rate 0) equals flow_grpo's KL loss written out above, to 1e-6."""
    policy = build_policy(make_cfg("sd3", folders["sd3"]), "cpu")
    perturb_lora(policy, scale=0.05)  # the adapter moved: the KL to the base is not 0
    g, steps, noise = GUIDANCE["sd3"], 4, 0.7
    rollout = sample_sde(policy, PROMPTS, SEEDS, steps, noise, guidance=g)
    cond, uncond = encode_conditioning(policy, PROMPTS, g)
    sigmas = policy.sigmas(steps)
    params = policy.trainable_parameters()
    batch = UpdateBatch(rollout=rollout, cond=cond, uncond=uncond, advantages=torch.tensor([1.0, -1.0]), sigmas=sigmas)
    [stats] = grpo_epoch(policy, params, torch.optim.SGD(params, lr=0.0), batch, optimizer_steps=1, clip_range=0.2,
                         noise_level=noise, guidance=g, max_grad_norm=1.0, kl_beta=0.01,
                         generator=torch.Generator().manual_seed(0))
    theirs = flow_grpo_kl(policy, rollout, cond, uncond, sigmas, noise, g).item()
    assert theirs > 1e-4, "the check is not vacuous"
    assert abs(stats["kl_ref"] - theirs) <= 1e-6


@pytest.mark.parametrize("kind", KINDS)
def test_trainable_state_is_the_adapter(kind, folders):
    cfg = make_cfg(kind, folders[kind])
    policy = build_policy(cfg, "cpu")
    perturb_lora(policy)
    state = policy.trainable_state()
    adapter = {n: p for n, p in policy.core.named_parameters() if "lora_" in n}
    assert state and all(".lora_A." in k or ".lora_B." in k for k in state)
    assert len(state) == len(adapter) == len(policy.trainable_parameters())
    assert sum(t.numel() * t.element_size() for t in state.values()) == sum(p.numel() for p in adapter.values()) * 4

    fresh = build_policy(cfg, "cpu")
    fresh.load_trainable_state(state)
    assert all(torch.equal(state[k], v) for k, v in fresh.trainable_state().items())
    x = initial_latents(policy)
    cond = policy.encode_prompts(PROMPTS)
    with torch.no_grad():
        assert torch.equal(fresh.velocity(x, torch.tensor(0.5), cond, 3.5),
                           policy.velocity(x, torch.tensor(0.5), cond, 3.5))


@pytest.mark.parametrize("kind", KINDS)
def test_exported_lora_loads_into_the_pipeline(kind, folders, tmp_path, monkeypatch):
    policy = build_policy(make_cfg(kind, folders[kind]), "cpu")
    perturb_lora(policy)
    g = GUIDANCE[kind]
    ours = sample_ode(policy, PROMPTS, SEEDS, STEPS, g, decode=False)
    out = export_lora(policy, policy.trainable_state(), tmp_path / "lora")
    assert (out / "pytorch_lora_weights.safetensors").is_file()

    pipe = load_pipeline(kind, folders[kind])
    x0 = initial_latents(policy)
    base = pipeline_sample(pipe, kind, x0, g, "latent")
    # as users call it; diffusers refuses a folder without weight_name in offline mode (even a local one),
    # so offline mode is off for this call: the folder is local, nothing can be fetched
    monkeypatch.setattr("diffusers.loaders.lora_base.HF_HUB_OFFLINE", False)
    pipe.load_lora_weights(out)
    theirs = pipeline_sample(pipe, kind, x0, g, "latent")
    assert (base - theirs).abs().max() > 0.05  # the adapter matters
    assert (ours - theirs).abs().max() < TOL  # and diffusers applies it as we trained it (alpha / rank too)

    # the export command has the run's config, not a policy: the same file from kind + model.lora
    again = export_lora(kind, policy.trainable_state(), tmp_path / "again", lora=policy.lora)
    assert read_lora(again) == read_lora(out)


def test_full_export_loads_as_the_pipeline_transformer(folders, tmp_path):
    policy = build_policy(make_cfg("sd3", folders["sd3"], lora=None), "cpu")
    with torch.no_grad():
        for p in policy.core.parameters():
            p.add_(0.01)
    ours = sample_ode(policy, PROMPTS, SEEDS, STEPS, 4.5, decode=False)
    folder = export_full(policy.transformer, tmp_path / "full")
    transformer = diffusers.SD3Transformer2DModel.from_pretrained(folder)
    pipe = diffusers.StableDiffusion3Pipeline.from_pretrained(folders["sd3"], transformer=transformer)
    assert (ours - pipeline_sample(pipe, "sd3", initial_latents(policy), 4.5, "latent")).abs().max() < TOL


def test_flux_without_guidance_embeds_batches_true_cfg(tmp_path):
    folder = build_tiny_pipeline("flux", tmp_path / "schnell", guidance_embeds=False)
    policy = build_policy(make_cfg("flux", folder), "cpu")
    assert not policy.embedded_guidance and policy.needs_uncond(3.5) and not policy.needs_uncond(1.0)
    calls = []
    hook = policy.core.register_forward_pre_hook(
        lambda m, args, kw: calls.append((kw["hidden_states"].shape[0], kw["guidance"])), with_kwargs=True)
    latents = sample_ode(policy, PROMPTS, SEEDS, STEPS, 3.5, decode=False)
    hook.remove()
    assert calls == [(4, None)] * STEPS  # conditional and unconditional rows in one pass, no guidance input
    pipe = load_pipeline("flux", folder)
    assert (latents - pipeline_sample(pipe, "flux", initial_latents(policy), 3.5, "latent")).abs().max() < TOL


def test_flux_dev_passes_guidance_as_an_input(folders):
    policy = build_policy(make_cfg("flux", folders["flux"], lora=None), "cpu")
    calls = []
    hook = policy.core.register_forward_pre_hook(
        lambda m, args, kw: calls.append((kw["hidden_states"].shape[0], kw["guidance"].tolist())), with_kwargs=True)
    sample_ode(policy, PROMPTS, SEEDS, 2, 3.5, decode=False)
    hook.remove()
    assert calls == [(2, [3.5, 3.5])] * 2  # one pass per step, no unconditional prompt


def test_qwen_image_rows_do_not_depend_on_their_batch(folders):
    policy = build_policy(make_cfg("qwen-image", folders["qwen-image"], lora=None), "cpu")
    alone = policy.encode_prompts(["a red cat"])
    batch = policy.encode_prompts(["a red cat", "a photo of a dog", ""])
    assert alone.tensors["tokens"].shape == (1, 32, 16) and alone.tensors["mask"].dtype == torch.long
    assert batch.tensors["mask"].sum(1).unique().numel() == 3  # three lengths, padded to one
    assert all(torch.equal(alone.tensors[k][0], batch.tensors[k][0]) for k in alone.tensors)
    policy.frozen._embeds.clear()  # a fresh encode equals the cached row bit for bit
    assert torch.equal(policy.encode_prompts(["a red cat"]).tensors["tokens"], alone.tensors["tokens"])

    x = draw(rollout_generators([1, 2, 3]), policy.latent_shape)
    with torch.no_grad():
        v_alone = policy.velocity(x[:1], torch.tensor(0.7), alone)
        v_batch = policy.velocity(x, torch.tensor(0.7), batch)
    assert (v_alone[0] - v_batch[0]).abs().max() < 1e-6


def test_frozen_parts_are_shared_and_each_policy_owns_its_transformer(folders):
    cfg = make_cfg("sd3", folders["sd3"])
    a, b = build_policy(cfg, "cpu"), build_policy(cfg, "cpu")
    assert a.frozen is b.frozen and a.transformer is not b.transformer
    assert {n for n, _ in a.named_parameters()} == {f"transformer.{n}" for n, _ in a.core.named_parameters()}
    assert not any(p.requires_grad for m in a.frozen.modules for p in m.parameters())


def test_bad_pretrained_fails_early_naming_it(folders, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigError, match=f"model.pretrained: {missing} does not exist"):
        build_policy(make_cfg("sd3", missing), "cpu")
    with pytest.raises(ConfigError, match=f"{tmp_path} has no model_index.json"):
        build_policy(make_cfg("sd3", tmp_path), "cpu")
    with pytest.raises(ConfigError, match="is a FluxPipeline, model.kind sd3 expects StableDiffusion3Pipeline"):
        build_policy(make_cfg("sd3", folders["flux"]), "cpu")
    partial = shutil.copytree(folders["qwen-image"], tmp_path / "partial")
    shutil.rmtree(partial / "vae")
    with pytest.raises(ConfigError, match=r"lacks the component folder\(s\) \['vae'\]"):
        build_policy(make_cfg("qwen-image", partial), "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_missing_lora_target_fails_before_loading_weights(kind, folders, tmp_path):
    broken = shutil.copytree(folders[kind], tmp_path / kind)
    weights = list((broken / "transformer").glob("*.safetensors"))
    assert weights
    for file in weights:
        file.write_bytes(b"not weights")  # only config.json may be read before the check
    lora = {**LORA, "target_modules": ["to_q", "not_a_module"]}
    transformer = json.loads((broken / "model_index.json").read_text())["transformer"][1]
    with pytest.raises(ConfigError, match=rf"model.lora.target_modules: \['not_a_module'\] match no module of the "
                                          rf"{transformer} in {broken}/transformer"):
        build_policy(make_cfg(kind, broken, lora=lora), "cpu")


@pytest.mark.parametrize("kind", KINDS)
def test_vae_decodes_in_fp32_under_bf16_weights(kind, folders):
    """``model.vae_fp32`` (default, flow_grpo's): with bf16 weights the VAE stays fp32, so the images the
    rewards score are those of an all-fp32 decode, bit for bit; off, it decodes in bf16."""
    def policy(dtype: str, vae_fp32: bool):
        return build_policy(config_from_dict({"model": {"kind": kind, "pretrained": str(folders[kind]),
                                                        "resolution": 32, "max_sequence_length": 32, "dtype": dtype,
                                                        "vae_fp32": vae_fp32}}), "cpu")
    full, bf16 = policy("bfloat16", True), policy("bfloat16", False)
    assert full.compute_dtype == torch.bfloat16 and full.pipe.vae.dtype == torch.float32
    assert bf16.pipe.vae.dtype == torch.bfloat16 and full.pipe.text_encoder.dtype == torch.bfloat16
    latents = initial_latents(full)
    with torch.no_grad():
        images = full.decode(latents)
        assert torch.equal(images, policy("float32", True).decode(latents))
        assert (bf16.decode(latents) - images).abs().max() > 1e-4  # what the fp32 decode is for


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_weights_with_gradient_checkpointing(kind, folders):
    """``model.dtype: bfloat16`` (what auto picks on CUDA; CPU autocast here): the base computes in
    bf16, the adapter, velocities, log-probs and the loss stay fp32, and gradient checkpointing gives
    the adapter the same gradients as without."""
    def grads(checkpointing: bool) -> list[torch.Tensor]:
        cfg = config_from_dict({"model": {"kind": kind, "pretrained": str(folders[kind]), "resolution": 32,
                                          "max_sequence_length": 32, "dtype": "bfloat16", "lora": LORA,
                                          "gradient_checkpointing": checkpointing}})
        policy = build_policy(cfg, "cpu")
        perturb_lora(policy)  # B != 0, so A gets gradients too
        assert policy.compute_dtype == torch.bfloat16 and policy.core.is_gradient_checkpointing == checkpointing
        assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
        g = GUIDANCE[kind]
        rollout = sample_sde(policy, PROMPTS, SEEDS, 2, 0.7, guidance=g)
        assert rollout.log_probs.dtype == rollout.images.dtype == torch.float32
        cond, uncond = encode_conditioning(policy, PROMPTS, g)
        lp, _ = step_log_prob(policy, rollout.latents[:, 1], rollout.latents[:, 2], torch.full((2,), 1), cond, uncond,
                              policy.sigmas(2), 0.7, g)
        assert lp.dtype == torch.float32 and (lp - rollout.log_probs[:, 1]).abs().max() <= 1e-6
        lp.sum().backward()
        return [p.grad for p in policy.trainable_parameters()]

    plain, checkpointed = grads(False), grads(True)
    assert all(g is not None and g.abs().sum() > 0 for g in plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed))


@pytest.mark.parametrize("import_spotlight", [False, True])
def test_spotlight_silences_transformers_torchvision_notice_and_no_other_warning(import_spotlight):
    """Importing a diffusers pipeline without torchvision makes transformers warn that it falls back to the PIL
    image processors; spotlight (which loads those itself) drops exactly that notice, on every command."""
    code = ("import spotlight\n" if import_spotlight else "") + (
        "import diffusers.pipelines.flux.pipeline_flux\n"
        "from transformers.utils import logging\n"
        "logging.get_logger('transformers.utils.import_utils').warning('another notice')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert ("requires torchvision (not installed); falling back to" in result.stderr) != import_spotlight
    assert "another notice" in result.stderr
