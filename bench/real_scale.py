"""One iteration of a shipped config at real size with random weights, and the memory plan checked against it.

    .venv/bin/python bench/real_scale.py --config configs/sd35m-pickscore.yaml        # a GPU: run this first
    OMP_NUM_THREADS=2 .venv/bin/python bench/real_scale.py --config configs/flux-dev-ocr.yaml   # CPU: depth-reduced

The config's architecture (``model.pretrained`` when it is on this machine, else the published
``configs/architectures/<model.architecture>``) is built with random weights: no weight is downloaded or
read. One iteration runs through the policy's own code: SDE rollouts with CFG (``sample_sde_batched``), the
decode, the reward, and the LoRA update (``grpo_epoch``: microbatches, AdamW). Prompts are random embeddings
of the exact shapes ``encode_prompts`` returns (there is no tokenizer in an architecture folder); each text
encoder still runs once per prompt on random token ids of its real length, so its time and memory count.
Rewards with a model on the GPU (PickScore, CLIP score, aesthetic) are that model's architecture with
random weights (same cost); a remote reward (HTTP) costs this GPU nothing and is left out.

- **CUDA** (full depth, the config's dtype): seconds per iteration, rollout images/s, update rows/s and
  ``torch.cuda.max_memory_allocated`` beside the plan's allocated peak (``spotlight plan``), and the
  reserved/allocated ratio the plan assumes is 1 + FRAGMENTATION.
- **CPU** (depth-reduced: the real width and resolution, one or two transformer blocks of each kind, the
  text encoders and the reward's towers at two layers; bf16 as on a GPU): the same iteration at a small
  batch, then the train step's activation peak measured by the CPU allocator itself
  (``torch.profiler``'s memory events: :func:`spotlight.memory.profiled_peak`) beside the plan's count of the
  same step (:class:`spotlight.memory.LiveBytes` on fake tensors), at one and two blocks with and without
  gradient checkpointing: the difference is one block, and the ratio is printed per block.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spotlight.config import Config, load_config  # noqa: E402
from spotlight.grpo import UpdateBatch, grpo_epoch, recipe_advantages  # noqa: E402
from spotlight.memory import GIB, LiveBytes, gib, profiled_peak  # noqa: E402
from spotlight.memory_plan import (FRAGMENTATION, REWARD_ARCHITECTURES, decode_batch, plan_memory,  # noqa: E402
                                   reward_model_on_meta, rollout_forward, train_step)
from spotlight.models.meta import model_folder, policy_on_meta  # noqa: E402
from spotlight.models.policy import DiffusionPolicy, PromptEmbeds  # noqa: E402
from spotlight.sampler import sample_sde_batched  # noqa: E402
from spotlight.seeding import generator  # noqa: E402

#: the layer counts a depth-reduced text encoder or reward tower keeps (their width stays real)
REDUCED_LAYERS = 2


# -- building at real size, random weights -----------------------------------------------------------------
def reduced_folder(folder: Path, out: Path, blocks: dict[str, int]) -> Path:
    """A copy of a pipeline's configs with the transformer's blocks set to ``blocks`` (e.g. ``{"num_layers": 2}``)
    and the text encoders at :data:`REDUCED_LAYERS` layers; the VAE, the widths and the resolution stay real."""
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt"))
    transformer = out / "transformer" / "config.json"
    config = json.loads(transformer.read_text())
    config.update(blocks)
    if "dual_attention_layers" in config:
        config["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < config["num_layers"]]
    transformer.write_text(json.dumps(config))
    for encoder in out.glob("text_encoder*/config.json"):
        config = json.loads(encoder.read_text())
        for section in (config, config.get("text_config") or {}):
            for key in ("num_hidden_layers", "num_layers", "num_decoder_layers"):
                if key in section:
                    section[key] = REDUCED_LAYERS
            if "layer_types" in section:
                section["layer_types"] = section["layer_types"][:REDUCED_LAYERS]
        if "vision_config" in config:
            config["vision_config"]["depth"] = REDUCED_LAYERS
            config["vision_config"]["fullatt_block_indexes"] = [REDUCED_LAYERS - 1]
        encoder.write_text(json.dumps(config))
    return out


def reduced_reward_folder(cfg: Config, name: str, out: Path) -> Path:
    from spotlight.memory_plan import reward_folder

    config = json.loads((reward_folder(cfg, name) / "config.json").read_text())
    for tower in ("text_config", "vision_config"):
        config[tower]["num_hidden_layers"] = REDUCED_LAYERS
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    return out


def materialize(module: nn.Module, device: torch.device, seed: int = 0) -> nn.Module:
    """Every parameter on ``meta`` becomes a random tensor on ``device`` (its dtype and ``requires_grad`` kept);
    buffers are moved (they were built real)."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where it lives: billions of values on a GPU
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                data = (torch.randn(p.shape, generator=gen, device=device) * 0.02).to(dtype=p.dtype)
                sub._parameters[name] = nn.Parameter(data, requires_grad=p.requires_grad)
    return module.to(device)


def present_targets(cfg: Config, folder: Path) -> Config:
    """``cfg`` with the LoRA targets the (depth-reduced) transformer has: SD3's last block has no context
    output (``attn.to_add_out``), so a one-block SD3 has none, as the full model's last block has none."""
    from spotlight.models.meta import component_classes, module_on_meta
    from spotlight.models.policy import missing_lora_targets

    if cfg.model.lora is None:
        return cfg
    transformer = module_on_meta(component_classes(folder)["transformer"], folder / "transformer")
    missing = set(missing_lora_targets(transformer, cfg.model.lora.target_modules))
    lora = cfg.model.lora.model_copy(update={"target_modules": tuple(t for t in cfg.model.lora.target_modules
                                                                     if t not in missing)})
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"lora": lora})})


def random_weight_policy(cfg: Config, folder: Path, device: torch.device, dtype: torch.dtype) -> DiffusionPolicy:
    policy = policy_on_meta(present_targets(cfg, folder), folder, dtype, real_buffers=True)
    materialize(policy.core, device)
    for m in policy.frozen_modules().values():
        materialize(m, device)
    return policy.to(device)


def stand_in_prompts(policy: DiffusionPolicy, seconds: dict[str, float]) -> None:
    """``encode_prompts`` without tokenizers: random embeddings of the exact shapes, cached per prompt as the
    real cache is, after running each text encoder once on random ids of its real length."""
    cache: dict[str, dict[str, torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(0)

    def encode(prompts):
        for prompt in prompts:
            if prompt not in cache:
                started = time.perf_counter()
                with torch.no_grad():
                    for name, tokens in policy.text_lengths().items():
                        ids = torch.randint(100, (1, tokens), generator=gen).to(policy.device)
                        policy.frozen_modules()[name](input_ids=ids, output_hidden_states=True)
                cache[prompt] = {k: (torch.randn(1, *shape, generator=gen) if dt.is_floating_point
                                     else torch.ones(1, *shape, dtype=dt)).to(dt)
                                 for k, (shape, dt) in policy.prompt_shapes().items()}
                seconds["text encoding"] = seconds.get("text encoding", 0.0) + time.perf_counter() - started
        return PromptEmbeds({k: torch.cat([cache[p][k] for p in prompts]) for k in cache[prompts[0]]}).to(policy.device)

    policy.encode_prompts = encode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def part_peak(device: torch.device, peaks: dict[str, int], name: str) -> None:
    """CUDA: the allocator's peak over the part that just ended, then a fresh count for the next part."""
    if device.type == "cuda":
        peaks[name] = torch.cuda.max_memory_allocated(device)
        peaks["reserved"] = max(peaks.get("reserved", 0), torch.cuda.max_memory_reserved(device))
        torch.cuda.reset_peak_memory_stats(device)


# -- one iteration --------------------------------------------------------------------------------------
def iteration(cfg: Config, policy: DiffusionPolicy, rewards: dict[str, nn.Module], prompts: int, group: int,
              device: torch.device, peaks: dict[str, int] | None = None) -> dict[str, float]:
    """Rollouts with CFG, decode, reward, LoRA update, as update(t) runs them; seconds per part (and on CUDA
    the allocator's peak per part into ``peaks``)."""
    peaks = {} if peaks is None else peaks
    sc, gc = cfg.sampler, cfg.grpo
    seconds: dict[str, float] = {}
    stand_in_prompts(policy, seconds)
    texts = [f"prompt {i}" for i in range(prompts) for _ in range(group)]
    seeds = list(range(len(texts)))
    policy.eval()
    sync(device)
    started = time.perf_counter()
    rollout = sample_sde_batched(policy, texts, seeds, sc.batch_size, steps=sc.train_steps, noise_level=sc.noise_level,
                                 guidance=sc.guidance, negative_prompt=sc.negative_prompt)
    sync(device)
    seconds["rollouts (with decode)"] = time.perf_counter() - started
    part_peak(device, peaks, "rollouts")
    started = time.perf_counter()
    scores = torch.zeros(len(texts), device=device)
    with torch.no_grad():
        for model in rewards.values():
            for start in range(0, len(texts), 128):  # the reward runtime's largest bucket
                side = model.config.vision_config.image_size
                pixels = nn.functional.interpolate(rollout.images[start:start + 128].float(), size=(side, side),
                                                   mode="bilinear")
                pooled = model.vision_model(pixel_values=pixels).pooler_output  # as ClipImageEmbedder
                embeds = nn.functional.normalize(model.visual_projection(pooled), dim=-1)
                scores[start:start + len(pixels)] += embeds.sum(dim=-1)
    sync(device)
    seconds["reward"] = time.perf_counter() - started
    part_peak(device, peaks, "reward")
    advantages = recipe_advantages(scores.view(prompts, group), gc)
    cond = policy.encode_prompts(texts)
    uncond = policy.encode_prompts([sc.negative_prompt] * len(texts)) if policy.needs_uncond(sc.guidance) else None
    batch = UpdateBatch(rollout, cond, uncond, advantages, policy.sigmas(sc.train_steps).to(device))
    params = policy.trainable_parameters()
    optimizer = torch.optim.AdamW(params, lr=gc.lr)
    policy.train()
    rows = len(texts) * cfg.trained_steps
    started = time.perf_counter()
    grpo_epoch(policy, params, optimizer, batch, optimizer_steps=gc.optimizer_steps, clip_range=gc.clip_range,
               noise_level=sc.noise_level, guidance=sc.guidance, max_grad_norm=gc.max_grad_norm, kl_beta=gc.kl_beta,
               microbatch_size=gc.microbatch_size, trained_steps=cfg.trained_steps, generator=generator(0, "bench"))
    sync(device)
    seconds["update"] = time.perf_counter() - started
    part_peak(device, peaks, "update")
    seconds["rows"] = rows
    seconds["images"] = len(texts)
    optimizer.zero_grad(set_to_none=True)
    return seconds


def reward_models(cfg: Config, device: torch.device, reduced_dir: Path | None) -> dict[str, nn.Module]:
    """The train rewards' GPU models as stand-ins: their architecture with random weights (fp32, as loaded)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, CLIPModel

    out = {}
    for name in cfg.rewards.train:
        if name not in REWARD_ARCHITECTURES:
            continue
        if reduced_dir is None:
            model = reward_model_on_meta(cfg, name)
        else:
            with init_empty_weights():
                model = CLIPModel(AutoConfig.from_pretrained(reduced_reward_folder(cfg, name, reduced_dir / name)))
            model = model.float()
        out[name] = materialize(model, device).eval().requires_grad_(False)
    return out


# -- the plan's count against the allocator's --------------------------------------------------------------
def _prepare(policy: DiffusionPolicy, checkpointing: bool, train: bool) -> None:
    policy.core.enable_gradient_checkpointing() if checkpointing else policy.core.disable_gradient_checkpointing()
    policy.train(train)
    if train:  # the update holds gradients from its first microbatch on
        for p in policy.trainable_parameters():
            p.grad = torch.zeros_like(p)


def measured_peak(cfg: Config, folder: Path, dtype: torch.dtype, phase, args: tuple, checkpointing: bool = False,
                  train: bool = False) -> int:
    """The CPU allocator's own peak over one phase (its memory events in torch.profiler), random weights."""
    policy = random_weight_policy(cfg, folder, torch.device("cpu"), dtype)
    _prepare(policy, checkpointing, train)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        phase(policy, *args, LiveBytes())
    return profiled_peak(prof)


def planned_peak(cfg: Config, folder: Path, dtype: torch.dtype, phase, args: tuple, checkpointing: bool = False,
                 train: bool = False) -> int:
    """The plan's count of the same phase: the policy on meta, fake tensors, :class:`LiveBytes` (no rounding)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    policy = policy_on_meta(present_targets(cfg, folder), folder, dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy.to_empty(device="cpu")
        _prepare(policy, checkpointing, train)
        with LiveBytes() as tracker:
            phase(policy, *args, tracker)
    return tracker.peak


def block_variants(cfg: Config) -> dict[str, dict[str, int]]:
    """Depths to build: one of each block kind, then one more of each kind in turn."""
    if cfg.model.kind == "flux":
        return {"1 double + 1 single": {"num_layers": 1, "num_single_layers": 1},
                "2 double + 1 single": {"num_layers": 2, "num_single_layers": 1},
                "1 double + 2 single": {"num_layers": 1, "num_single_layers": 2}}
    return {"1 block": {"num_layers": 1}, "2 blocks": {"num_layers": 2}}


def cpu_report(cfg: Config, args: argparse.Namespace, dtype: torch.dtype, tmp: Path) -> None:
    variants = block_variants(cfg)
    folders = {name: reduced_folder(model_folder(cfg.model), tmp / name.replace(" ", "_"), blocks)
               for name, blocks in variants.items()}
    two = next(name for name, blocks in variants.items() if sum(blocks.values()) == 2)
    print(f"# {args.config} on cpu ({dtype}), depth-reduced: real width, {cfg.model.resolution} px; text encoders "
          f"and reward towers at {REDUCED_LAYERS} layers; load average {os.getloadavg()[0]:.1f}", flush=True)
    policy = random_weight_policy(cfg, folders[two], torch.device("cpu"), dtype)
    if cfg.model.gradient_checkpointing:
        policy.core.enable_gradient_checkpointing()
    rewards = reward_models(cfg, torch.device("cpu"), tmp / "rewards")
    seconds = iteration(cfg, policy, rewards, args.prompts, args.group, torch.device("cpu"))
    print(f"one iteration ({two}): {seconds['images']} rollouts x {cfg.sampler.train_steps} steps (guidance "
          f"{cfg.sampler.guidance}) {seconds['rollouts (with decode)']:.1f} s, reward {seconds['reward']:.1f} s "
          f"({', '.join(rewards) or 'none on this device'}), update of {seconds['rows']} rows {seconds['update']:.1f} s",
          flush=True)
    del policy, rewards
    sc, rows = cfg.sampler, cfg.grpo.microbatch_size
    cfg_rows = 2 if sc.guidance != 1.0 and cfg.model.kind != "flux" else 1
    print("\nactivation peaks in MiB: measured = the CPU allocator's own record (torch.profiler memory events), "
          "planned = the plan's LiveBytes on fake tensors")
    print(f"{'phase':<58} {'measured':>10} {'planned':>10} {'planned/measured':>17}")

    def row(name: str, measured: int, planned: int, note: str = "") -> None:
        ratio = f"{planned / measured:.3f}" if measured else "equal (0)" if planned == measured else "inf"
        print(f"{name:<58} {measured / 2**20:>10.1f} {planned / 2**20:>10.1f} {ratio:>17}{note}", flush=True)

    for phase, label, phase_args in ((rollout_forward, f"rollout forward, {args.rows} seeds x{cfg_rows} (CFG)",
                                      (args.rows, sc.guidance)),
                                     (decode_batch, f"VAE decode, {args.rows} images", (args.rows,))):
        row(f"{label} ({two})", measured_peak(cfg, folders[two], dtype, phase, phase_args),
            planned_peak(cfg, folders[two], dtype, phase, phase_args))
    step_args = (rows, sc.guidance, sc.noise_level, sc.train_steps)
    for checkpointing in (False, True):
        results = {}
        for name, folder in folders.items():
            results[name] = tuple(f(cfg, folder, dtype, train_step, (*step_args, checkpointing), checkpointing, True)
                                  for f in (measured_peak, planned_peak))
            row(f"train step {rows} rows x{cfg_rows}, checkpointing {'on' if checkpointing else 'off'} ({name})",
                *results[name])
        base = list(folders)[0]
        for name in list(folders)[1:]:
            kind = ("single-stream block" if "2 single" in name else "double-stream block") if cfg.model.kind == "flux" \
                else "block"
            row(f"  one {kind}, checkpointing {'on' if checkpointing else 'off'} ({name} - {base})",
                results[name][0] - results[base][0], results[name][1] - results[base][1], "   <- per block")
    plan = plan_memory(cfg)
    key = "train step (without gradient checkpointing)"
    print(f"\nfull depth, the plan: {key} {gib(plan.peaks[key])} GiB, with checkpointing "
          f"{gib(plan.peaks['train step (with gradient checkpointing)'])} GiB (bf16, CUDA 512-byte blocks)")


def full_report(cfg: Config, args: argparse.Namespace, dtype: torch.dtype, device: torch.device) -> None:
    """Full depth (a GPU; or ``--full`` on the CPU, e.g. with a tiny pipeline as ``model.pretrained``): one
    iteration at the config's size, its speed, and the allocator's peak beside the plan's."""
    plan = plan_memory(cfg)
    trainer = plan.workers["trainer"]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where, total_memory = f"{props.name} ({props.total_memory / GIB:.1f} GiB)", props.total_memory
    else:
        where, total_memory = f"cpu (load average {os.getloadavg()[0]:.1f})", None
    print(f"# {args.config} on {where}, {dtype}, full depth, {cfg.model.resolution} px, random weights", flush=True)
    started = time.perf_counter()
    policy = random_weight_policy(cfg, model_folder(cfg.model), device, dtype)
    if cfg.model.gradient_checkpointing:
        policy.core.enable_gradient_checkpointing()
    rewards = reward_models(cfg, device, None)
    planned_weights = sum(p.bytes for p in trainer.weights if not p.name.startswith("reward")
                          or any(f"reward {name} " in p.name for name in rewards))
    planned_weights += sum(p.bytes for p in trainer.training if "adapter" in p.name)
    built = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    print(f"built in {time.perf_counter() - started:.1f} s; weights "
          + (f"allocated {built / GIB:.2f} GiB, " if built is not None else "")
          + f"the plan's {gib(planned_weights)} GiB", flush=True)
    prompts = args.prompts or cfg.grpo.prompts_per_iteration
    group = args.group or cfg.grpo.group_size
    peaks: dict[str, int] = {}
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the reserved peak is the iteration's, not the random initialisation's
        torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        seconds = iteration(cfg, policy, rewards, prompts, group, device, peaks)
        total = time.perf_counter() - started
        reserved = peaks.pop("reserved")
        peak = max(peaks.values())
    else:  # the CPU allocator has no cache: its peak above the weights, from its own record
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            started = time.perf_counter()
            seconds = iteration(cfg, policy, rewards, prompts, group, device)
            total = time.perf_counter() - started
        peak = planned_weights + profiled_peak(prof)
        reserved = peak
    print(f"s/iteration {total:.1f} (rollouts {seconds['rollouts (with decode)']:.1f}, reward {seconds['reward']:.1f}, "
          f"update {seconds['update']:.1f}, text encoding {seconds.get('text encoding', 0):.1f})")
    print(f"rollout images/s {seconds['images'] / seconds['rollouts (with decode)']:.2f}; update rows/s "
          f"{seconds['rows'] / seconds['update']:.2f}")
    ran = [ph for ph in trainer.phases if ph.name.startswith(("update", "text")) or "(train), " in ph.name]
    worst = max(ran, key=lambda ph: ph.total)
    planned = trainer.static + worst.total
    print(f"peak allocated {peak / GIB:.2f} GiB vs the plan's {gib(planned)} GiB for the phases run here "
          f"(ratio {peak / planned:.3f}; the plan's peak among them: {worst.name}); not run here: evaluation and the "
          f"reward runtime's parity batch (the plan's peak over every phase: {gib(trainer.allocated)} GiB, "
          f"{trainer.worst.name})")
    for part, names in (("rollouts", ("update rollout", "update decode", "text")), ("reward", (" (train), ",)),
                        ("update", ("update train step",))):
        matching = [ph for ph in ran if any(n in ph.name for n in names)]
        if part in peaks and matching:
            planned_part = trainer.static + max(ph.total for ph in matching)
            print(f"  {part:<9} peak allocated {peaks[part] / GIB:6.2f} GiB vs the plan's {gib(planned_part)} GiB "
                  f"(ratio {peaks[part] / planned_part:.3f})")
    if total_memory is not None:
        print(f"max_memory_reserved / allocated {reserved / peak:.3f} (the plan assumes {1 + FRAGMENTATION:.2f}); "
              f"the plan's need {gib(trainer.need)} GiB of {total_memory / GIB:.1f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--prompts", type=int, default=None, help="prompts in the iteration (CPU default 1; CUDA: "
                        "grpo.prompts_per_iteration)")
    parser.add_argument("--group", type=int, default=None, help="rollouts per prompt (CPU default 2; CUDA: grpo.group_size)")
    parser.add_argument("--rows", type=int, default=2, help="CPU: rollout seeds and decoded images in the "
                        "measured inference phases")
    parser.add_argument("--full", action="store_true", help="on the CPU too: the full-depth iteration a GPU runs (with a "
                        "small model.pretrained: what checks this path without a GPU)")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.float32 if cfg.model.dtype == "float32" else torch.bfloat16
    torch.manual_seed(0)
    if device.type == "cuda" or args.full:
        full_report(cfg, args, dtype, device)
        return
    args.prompts, args.group = args.prompts or 1, args.group or 2
    with tempfile.TemporaryDirectory(prefix="real-scale-") as tmp:
        cpu_report(cfg, args, dtype, Path(tmp))


if __name__ == "__main__":
    main()
