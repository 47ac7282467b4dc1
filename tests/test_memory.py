"""The memory plan and one transformer per process.

- The published architectures build on meta at their known sizes; on the tiny pipelines, what the meta
  builder counts equals what ``from_pretrained`` loads, byte for byte and dtype by dtype.
- ``LiveBytes`` on fake tensors counts a training step's peak as the CPU allocator itself records it
  (torch.profiler's memory events of the same step run for real).
- ``spotlight plan`` prints each worker's memory with its parts for the three shipped configs with no weights
  on disk, drops accelerators that cannot hold a worker, and exits non-zero naming the worker, the accelerator
  and the shortfall when none can; a cloud run fails the same way before anything starts.
- A trainer process running update, evaluate, ranking and explorations holds one transformer: its resident
  parameter bytes are the plan's weights plus the adapter, and at an optimizer step the gradients and AdamW
  state the plan counts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from spotlight.config import load_config
from spotlight.memory import LiveBytes, bytes_by_dtype, module_tensors, profiled_peak
from spotlight.memory_plan import fit_placement, plan_memory, worker_weight_bytes
from spotlight.models.meta import ARCHITECTURES_DIR, components_on_meta, policy_on_meta
from spotlight.models.tiny_clip import build_tiny_clip
from spotlight.models.tiny_pipelines import build_tiny_pipeline
from tests.conftest import REPO, cli_env
from tests.test_real_pipelines import SHRINK, TEST, TRAIN

CONFIGS = {"sd3": "sd35m-pickscore.yaml", "flux": "flux-dev-ocr.yaml", "qwen-image": "qwen-image-pickscore.yaml"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-pipelines")
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("\n".join(TRAIN) + "\n")
    (prompts / "test.txt").write_text("\n".join(TEST) + "\n")
    return {**{kind: build_tiny_pipeline(kind, root / kind) for kind in CONFIGS}, "clip": build_tiny_clip(root / "clip"),
            "prompts": prompts}


@pytest.fixture(scope="module")
def flux_plan():
    """The FLUX.1-dev config's plan, computed once: the CLI tests below reuse it (plans are cached per recipe).
    The other two configs' plans are in docs/memory.md with the command that printed them."""
    return plan_memory(load_config(REPO / "configs" / CONFIGS["flux"]))


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_published_architectures_build_on_meta_at_their_sizes():
    sizes = {name: {k: _params(m) for k, m in components_on_meta(ARCHITECTURES_DIR / name).items()
                    if isinstance(m, torch.nn.Module)}
             for name in ("sd3.5-medium", "sd3.5-large", "flux.1-dev", "qwen-image")}
    assert sizes["qwen-image"]["transformer"] == 20_430_401_088, "the published count (40.86 GB of bf16 shards)"
    assert round(sizes["sd3.5-medium"]["transformer"] / 1e9, 2) == 2.24
    assert round(sizes["sd3.5-large"]["transformer"] / 1e9, 2) == 8.06
    assert round(sizes["flux.1-dev"]["transformer"] / 1e9, 1) == 11.9
    assert round(sizes["qwen-image"]["text_encoder"] / 1e9, 2) == 8.29, "Qwen2.5-VL-7B with its vision tower"
    t5 = sizes["sd3.5-medium"]["text_encoder_3"]
    assert t5 == sizes["flux.1-dev"]["text_encoder_2"] and round(t5 / 1e9, 2) == 4.76, "T5-XXL, embeddings tied"


@pytest.mark.parametrize("kind", CONFIGS)
def test_meta_counts_what_from_pretrained_loads(kind, tiny):
    from spotlight.models.export import pipeline_class

    loaded = pipeline_class(kind).from_pretrained(tiny[kind], torch_dtype=torch.bfloat16)
    meta = components_on_meta(tiny[kind], torch.bfloat16)
    for name, module in meta.items():
        if isinstance(module, torch.nn.Module):
            real = getattr(loaded, name)
            assert bytes_by_dtype(module_tensors(module)) == bytes_by_dtype(module_tensors(real)), name


@pytest.mark.parametrize("kind", CONFIGS)
def test_prompt_shapes_and_text_lengths_are_what_encoding_does(kind, tiny):
    cfg = load_config(REPO / "configs" / CONFIGS[kind], [*SHRINK, f"model.pretrained={tiny[kind]}",
                                                         f"data.prompts={tiny['prompts']}", "model.dtype=float32"])
    from spotlight.models.policy import build_policy

    policy = build_policy(cfg)
    seen: dict[str, int] = {}
    for name, module in policy.frozen_modules().items():
        module.register_forward_pre_hook(lambda m, args, kw, name=name: seen.__setitem__(name, kw["input_ids"].shape[1])
                                         if "input_ids" in kw else seen.__setitem__(name, args[0].shape[1]),
                                         with_kwargs=True)
    embeds = policy.encode_prompts([TRAIN[0]])
    assert {k: (tuple(t.shape[1:]), t.dtype) for k, t in embeds.tensors.items()} == policy.prompt_shapes()
    lengths = policy.text_lengths()
    assert set(seen) == set(lengths)
    for name, n in seen.items():  # Qwen-Image reads its template and the prompt: at most the plan's length
        assert n == lengths[name] if kind != "qwen-image" else 34 < n <= lengths[name], (name, n, lengths[name])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_live_bytes_on_fake_tensors_count_what_the_cpu_allocator_records(checkpointing, tiny):
    """The plan's method (fake tensors, no weights) against the allocator's own record of the same step run for
    real (torch.profiler's memory events): a LoRA training step of the tiny SD3 pipeline with CFG."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from spotlight.memory_plan import train_step
    from spotlight.models.policy import build_policy

    cfg = load_config(REPO / "configs" / "sd35m-pickscore.yaml", [f"model.pretrained={tiny['sd3']}", "model.resolution=32",
                                                                  "model.dtype=float32", "model.lora.rank=4",
                                                                  f"model.gradient_checkpointing={checkpointing}"])
    real = build_policy(cfg).train()
    for p in real.trainable_parameters():
        p.grad = torch.zeros_like(p)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        train_step(real, 8, 4.5, 0.7, 10, checkpointing, LiveBytes())
    measured = profiled_peak(prof)

    planned = policy_on_meta(cfg, dtype=torch.float32)
    if checkpointing:
        planned.core.enable_gradient_checkpointing()
    with FakeTensorMode(allow_non_fake_inputs=True):
        planned.to_empty(device="cpu")
        for p in planned.trainable_parameters():
            p.grad = torch.zeros_like(p)
        planned.train()
        with LiveBytes() as tracker:
            train_step(planned, 8, 4.5, 0.7, 10, checkpointing, tracker)
    assert measured > 1e6 and abs(tracker.peak - measured) / measured < 0.01, (tracker.peak, measured)


def test_the_cli_help_says_what_spotlight_is_and_lists_run_and_plan_first():
    from flows.cli import app

    result = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Flow-GRPO post-training of diffusion transformers" in result.output
    assert "Library commands" not in result.output  # the module's note to developers stays in the code
    listed = [line.split()[1] for line in result.output.splitlines()
              if line.startswith("│ ") and len(line.split()) > 2 and not line.split()[1].startswith("-")]
    assert listed[:2] == ["run", "plan"] and set(listed) == {"run", "plan", "simulate", "report", "export", "worker",
                                                              "stage", "tiny-model"}, listed


def test_plan_prints_every_worker_with_its_parts_without_weights(flux_plan):
    config = REPO / "configs" / CONFIGS["flux"]
    assert not Path(load_config(config).model.pretrained).exists(), "no weights on disk"
    from flows.cli import app

    result = CliRunner().invoke(app, ["plan", "--config", str(config), "--no-prices"])
    assert result.exit_code == 0, result.output
    out = result.output
    for text in ("trainer: needs", "explorer: needs", "transformer (bfloat16)", "vae (float32)", "LoRA adapter (float32)",
                 "LoRA gradients (float32)", "AdamW moments (float32)", "train step (with gradient checkpointing)",
                 "train step (without gradient checkpointing)", "rollout", "fits"):
        assert text in out, text
    trainer, explorer = flux_plan.workers["trainer"], flux_plan.workers["explorer"]
    assert f"trainer: needs {trainer.need / 2**30:.2f} GiB" in out
    comment = config.read_text()  # the config states the plan's figures, not estimates
    assert f"a trainer needs {trainer.need / 2**30:.1f} GiB" in comment and f"an explorer {explorer.need / 2**30:.1f} GiB" \
        in comment
    assert trainer.need > trainer.allocated > trainer.static > 0
    assert sum(p.bytes for p in trainer.weights) == worker_weight_bytes(load_config(config), "trainer")


def test_plan_fails_naming_the_worker_and_the_shortfall(flux_plan, monkeypatch, capsys):
    from flows.cli import main

    monkeypatch.setattr(sys, "argv", ["spotlight", "plan", "--config", str(REPO / "configs" / CONFIGS["flux"]),
                                      "--no-prices", "--set", "placement.trainer.accelerators=[T4:1]"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    need = flux_plan.workers["trainer"].need / 2**30
    assert f"the trainer needs {need:.2f} GiB per GPU" in err and "T4:1 has 16.00 GiB (short by" in err, err


def test_accelerators_that_cannot_hold_a_worker_are_dropped(flux_plan):
    cfg = load_config(REPO / "configs" / "flux-dev-ocr.yaml", ["placement.explorer.accelerators=[L4:1,A100-80GB:1]"])
    fitted, dropped = fit_placement(cfg)
    assert fitted.placement.explorer.accelerators == ("A100-80GB:1",)
    assert fitted.placement.trainer.accelerators == cfg.placement.trainer.accelerators
    assert len(dropped) == 1 and dropped[0].startswith("explorer: dropped L4:1 (22.35 GiB per GPU")


def test_a_cloud_run_fails_before_anything_starts(flux_plan, tmp_path, monkeypatch):
    from flows.cli import app

    monkeypatch.setenv("SPOTLIGHT_LAUNCHER", "sky")
    result = CliRunner().invoke(app, ["run", "--config", str(REPO / "configs" / CONFIGS["flux"]),
                                      "--set", f"run.url=file://{tmp_path}/run",
                                      "--set", "placement.explorer.accelerators=[L4:1,A10G:1]"])
    assert result.exit_code != 0
    assert "explorer needs" in str(result.exception) and "A10G:1 has 22.35 GiB" in str(result.exception)
    assert not (tmp_path / "run").exists(), "nothing was started: no run store"


def test_a_trainer_process_holds_one_transformer(tiny, tmp_path):
    sets = [*SHRINK, f"model.pretrained={tiny['sd3']}", f"data.prompts={tiny['prompts']}", "model.dtype=float32",
            f"rewards.pickscore.model={tiny['clip']}", "rewards.pickscore.processor=null", "exploration.ranking_prompts=1",
            f"run.url=file://{tmp_path}/run", f"run.cache_url=file://{tmp_path}/cache", "grpo.kl_beta=0.01"]
    out = tmp_path / "residency.json"
    result = subprocess.run([sys.executable, "-m", "tests.trainer_residency", str(out), *sets], capture_output=True,
                            text=True, env=cli_env(tmp_path), cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(out.read_text())
    trainer = plan_memory(load_config(REPO / "configs" / "sd35m-pickscore.yaml", sets), ema=False).workers["trainer"]
    weights = sum(p.bytes for p in trainer.weights)
    adapter, grads, adamw = (next(p.bytes for p in trainer.training if p.name.startswith(n))
                             for n in ("LoRA adapter", "LoRA gradients", "AdamW moments"))
    steps = [r for r in records if r["when"].endswith("optimizer step")]
    assert len(steps) == 2 and len(records) == 7
    for r in records:
        assert r["modules"]["SD3Transformer2DModel"] == 1, r["when"]
        # the reward's preprocessing keeps its resize matrices as buffers (kilobytes): the plan does not count them;
        # PickScore's logit scale (one fp32 scalar) is read into a float, and its CLIPModel wrapper freed
        assert r["parameters"] - r["preprocess_buffers"] == weights + adapter - 4, r["when"]
        assert r["gradients"] == (grads if r in steps else 0), r["when"]
        # AdamW: two moments per adapter tensor, and its step counter (a host scalar per tensor)
        assert r["optimizer_state"] == (adamw + 4 * r["trainable_tensors"] if r in steps else 0), r["when"]


def test_a_kl_to_the_ema_counts_the_swap_instead_of_a_theta_0_copy():
    """Full fine-tuning with a KL keeps theta_0 as a second transformer; with ``grpo.kl_reference: ema`` the
    average is swapped into the trained module instead, which holds the live weights aside meanwhile: the
    same bytes, named for what they are. With LoRA the swap holds the adapter aside."""
    def training(*sets: str) -> dict[str, int]:
        cfg = load_config(REPO / "configs" / "tiny.yaml", ["grpo.ema.decay=0.9", *sets])
        return {p.name: p.bytes for p in plan_memory(cfg).workers["trainer"].training}

    base, ema = training(), training("grpo.kl_reference=ema")
    swap = "live weights' copy, EMA swapped in (KL)"
    assert "theta_0 reference copy (KL)" in base and swap not in base
    assert "theta_0 reference copy (KL)" not in ema and ema[swap] == base["theta_0 reference copy (KL)"]
    assert sum(ema.values()) == sum(base.values())
    assert swap not in training("grpo.kl_reference=ema", "grpo.kl_beta=0")
    lora = training("grpo.kl_reference=ema", "model.lora={rank: 4}")
    assert lora[swap] == lora["LoRA adapter (float32)"] and "theta_0 reference copy (KL)" not in lora
