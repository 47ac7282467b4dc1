"""Bad input fails before any compute, with a message that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spotlight.config import ConfigError, load_config
from tests.conftest import REPO, SPOTLIGHT, run_cli, spotlight_cmd


def test_default_config_file_matches_defaults():
    assert load_config(REPO / "configs/tiny.yaml") == load_config(None)


@pytest.mark.parametrize("override, needle", [
    ("grpo.learning_rate=1e-3", "grpo.learning_rate: unknown key"),
    ("sampler.nonsense=1", "sampler.nonsense: unknown key"),
    ("grpo.group_size=0", "group size must be >= 2"),
    ("grpo.group_size=-4", "group size must be >= 2"),
    ("rewards.train=aesthetic", "reward 'aesthetic' needs its weights: set rewards.aesthetic"),
    ("rewards.eval=nope", "known rewards: aesthetic, clip_score, digit_classifier, heldout_classifier, "
                          "jpeg_compressibility, pickscore"),
    ("exploration.mode=fast", "exploration.mode"),
    ("rewards.runtime=tensorrt", "unknown reward runtime 'tensorrt'"),
    ("run.device=gpu", "unknown device 'gpu'; devices: auto, cpu, cuda, cuda:N"),
    ("run.device=cpu:1", "unknown device 'cpu:1'"),
    ("exploration.coarsen=3", "exploration.coarsen (3) must divide sampler.train_steps (10)"),
    ("placement.trainer.workers=0", "placement.trainer.workers is 0: a run needs at least one trainer"),
    ("placement.explorer.accelerators=[L40X:1]", "placement.explorer.accelerators: Value error, accelerator 'L40X' "
                                                 "is not in SkyPilot's catalog (sky/catalog/v8/common/accelerators.csv)"),
    ("placement.trainer.accelerators=[A100:0]", "accelerator 'A100:0': expected NAME or NAME:COUNT"),
    ("placement.lease_seconds=0", "placement.lease_seconds: Input should be greater than 0"),
    ("placement.trainer.accelerators=[A10:1]", "placement.trainer: Value error, accelerator A10:1 cannot be priced: "
                                               "the shipped catalog has no on-demand price for A10:1"),
    ("placement.explorer.accelerators=[B200:1]", "placement.explorer: Value error, accelerator B200:1 cannot be "
                                                 "priced: the shipped catalog has no spot price for B200:1"),
    ("grpo.minibatch_size=64", "grpo.minibatch_size is now grpo.optimizer_steps"),
    ("grpo.optimizer_steps=577", "grpo.optimizer_steps (577) exceeds the rows an iteration trains: 576 "
                                 "(prompts_per_iteration 8 x group_size 8 x 9 trained steps)"),
])
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny.yaml", [override])
    assert needle in str(err.value)


REAL = {"sd3": "sd35m-pickscore.yaml", "flux": "flux-dev-ocr.yaml", "qwen-image": "qwen-image-pickscore.yaml"}


@pytest.mark.parametrize("kind", REAL)
def test_real_configs_take_flow_grpos_recipe(kind):
    """Where a flow_grpo user looks (config/grpo.py, scripts/train_sd3.py, train_flux.py): AdamW weight
    decay 1e-4, two optimizer steps per iteration over the rows actually trained (timestep_fraction 0.99),
    each an equal share; EMA 0.9 every 8 steps for SD3 and FLUX (their train.ema; Qwen-Image's is off);
    the VAE in fp32; Qwen-Image's 512 text tokens and LoRA on its MLP projections too."""
    cfg = load_config(REPO / "configs" / REAL[kind])
    gc = cfg.grpo
    assert gc.weight_decay == 1e-4 and gc.optimizer_steps == 2 and cfg.model.vae_fp32
    rows = gc.prompts_per_iteration * gc.group_size * cfg.trained_steps
    assert cfg.trained_steps == int(cfg.sampler.train_steps * 0.99) and rows % gc.optimizer_steps == 0
    if kind == "qwen-image":
        assert gc.ema is None and cfg.model.max_sequence_length == 512
        assert {"img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"} <= \
            set(cfg.model.lora.target_modules)
    else:
        assert (gc.ema.decay, gc.ema.every) == (0.9, 8)


def test_a_mapping_given_whole_replaces_the_files_and_a_dotted_key_sets_one_entry(tmp_path):
    """`--set rewards.train='{jpeg_compressibility: 1.0}'` on a config whose file says `{pickscore: 1.0}`
    trains on JPEG compressibility alone (it used to merge, keep pickscore and fail on its weights)."""
    sd3 = REPO / "configs/sd35m-pickscore.yaml"
    whole = load_config(sd3, ["rewards.train={jpeg_compressibility: 1.0}", "rewards.eval={jpeg_compressibility: 2}"])
    assert whole.rewards.train == {"jpeg_compressibility": 1.0} and whole.rewards.eval == {"jpeg_compressibility": 2.0}
    one = load_config(sd3, ["rewards.train.jpeg_compressibility=0.5"])
    assert one.rewards.train == {"pickscore": 1.0, "jpeg_compressibility": 0.5}
    both = load_config(sd3, ["rewards.train={jpeg_compressibility: 1.0}", "rewards.train.pickscore=0.25"])
    assert both.rewards.train == {"jpeg_compressibility": 1.0, "pickscore": 0.25}
    assert load_config(sd3).rewards.train == {"pickscore": 1.0}, "the file's own mapping is unchanged"


def test_unknown_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  iterations: 2\n  gruop_size: 4\n")
    with pytest.raises(ConfigError, match=r"grpo.gruop_size: unknown key"):
        load_config(bad)


@pytest.mark.parametrize("override, needle", [
    ("grpo.group_size=0", "group size must be >= 2"),
    ("rewards.train=nope", "unknown reward 'nope'"),
    ("grpo.bogus=1", "grpo.bogus: unknown key"),
    ("placement.trainer.workers=0", "a run needs at least one trainer"),
    ("placement.trainer.accelerators=[Z100:8]", "accelerator 'Z100' is not in SkyPilot's catalog"),
    *([("run.device=cuda", "run.device is 'cuda' but torch")] if not torch.cuda.is_available() else []),
])
def test_cli_fails_before_any_compute(tmp_path: Path, override, needle):
    result = run_cli(spotlight_cmd("run", overrides=[override, f"run.url=file://{tmp_path}/run"]), tmp_path, 120, ephemeral=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert needle in result.stdout + result.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written before the config is valid"
    assert not (tmp_path / "prefect-home").exists() or not any((tmp_path / "prefect-home").rglob("*.db")), \
        "Prefect must not even start"


def test_run_refuses_a_different_config(tmp_path, small_overrides):
    from spotlight.run import open_run

    open_run(load_config(REPO / "configs/tiny.yaml", small_overrides))
    with pytest.raises(ConfigError, match=r"grpo.lr: 0.0002 \(started\) vs 0.5 \(now\)"):
        open_run(load_config(REPO / "configs/tiny.yaml", [*small_overrides, "grpo.lr=0.5"]))


def test_auto_device_is_what_this_machine_has(tmp_path, small_overrides):
    from spotlight.run import open_run

    run = open_run(load_config(REPO / "configs/tiny.yaml", [*small_overrides, "run.device=auto"]))
    assert run.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert run.cfg.run.device == "auto", "the run records the setting, so it resumes on any machine"


@pytest.fixture(scope="module")
def tiny_sd3(tmp_path_factory) -> Path:
    from spotlight.models.tiny_pipelines import build_tiny_pipeline

    return build_tiny_pipeline("sd3", tmp_path_factory.mktemp("sd3") / "pipe")


def test_real_model_config_without_weights_fails_at_once(tmp_path: Path):
    cmd = [SPOTLIGHT, "run", "--config", str(REPO / "configs/sd35m-pickscore.yaml"), "--set", f"run.url=file://{tmp_path}/run"]
    result = run_cli(cmd, tmp_path, 120, ephemeral=True)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.pretrained: /models/stable-diffusion-3.5-medium does not exist" in " ".join(result.stderr.split())
    assert not (tmp_path / "run").exists() and not (tmp_path / "prefect-home").exists()


@pytest.mark.parametrize("sets, needle", [
    (["data.prompts={tmp}/nowhere.txt"], "prompt file {tmp}/nowhere.txt does not exist"),
    (["data.prompts={tmp}/empty.txt"], "prompt file {tmp}/empty.txt is empty"),
    (["data.prompts={tmp}/bad.jsonl"], "{tmp}/bad.jsonl:2: not JSON"),
    (["data.prompts={tmp}/twice.jsonl"], "{tmp}/twice.jsonl:3: prompt 'a red cat' has other metadata than at "
                                         "{tmp}/twice.jsonl:1"),
    (["rewards.train={{nope: 1.0}}"], "unknown reward 'nope'"),
    (["rewards.train={{pickscore: lots}}"], "rewards.train.pickscore: Input should be a valid number"),
    (["model.lora.target_modules=[to_q, attn.nope]"],
     "model.lora.target_modules: ['attn.nope'] match no module of the SD3Transformer2DModel"),
    (["rewards.pickscore.model={tmp}/no-clip"], "{tmp}/no-clip"),
])
def test_real_model_inputs_are_checked_before_compute(tmp_path: Path, tiny_sd3, sets, needle):
    """What `spotlight run` checks after parsing the config and before starting anything (check_inputs)."""
    from spotlight.run import check_inputs

    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a red cat"}\n{"prompt": \n')
    (tmp_path / "twice.jsonl").write_text('{"prompt": "a red cat", "tag": "colors"}\n"a dog"\n'
                                          '{"prompt": "a red cat", "tag": "counting"}\n')
    base = [f"model.pretrained={tiny_sd3}", f"data.prompts={tmp_path}/prompts.txt", f"run.url=file://{tmp_path}/run"]
    with pytest.raises(ConfigError) as err:
        check_inputs(load_config(REPO / "configs/sd35m-pickscore.yaml", [*base, *[s.format(tmp=tmp_path) for s in sets]]))
    assert needle.format(tmp=tmp_path) in " ".join(str(err.value).split())
    assert not (tmp_path / "run").exists()


def test_placement_may_change_on_resume_and_is_recorded_while_the_recipe_stays_pinned(tmp_path, small_overrides):
    from spotlight.run import current_placement, open_run, open_run_from_url, placement_history

    first = open_run(load_config(REPO / "configs/tiny.yaml", small_overrides))
    assert placement_history(first.store) == []
    moved = ["placement.explorer.workers=4", "placement.trainer.use_spot=false", "placement.lease_seconds=60",
             "evaluation.target=0.9"]
    run = open_run(load_config(REPO / "configs/tiny.yaml", [*small_overrides, *moved]))  # not refused
    [change] = placement_history(run.store)
    assert change["placement"]["explorer"]["workers"] == 4 and change["placement"]["trainer"]["use_spot"] is False
    assert "  explorer.workers: 1 (started) vs 4 (now)" in change["changes"]
    assert "  lease_seconds: 30.0 (started) vs 60.0 (now)" in change["changes"]
    open_run(load_config(REPO / "configs/tiny.yaml", [*small_overrides, *moved]))  # the same again: nothing new
    assert len(placement_history(run.store)) == 1
    worker_view = open_run_from_url(run.store.url)  # what a worker opening the run by its URL sees
    assert worker_view.cfg.placement == run.cfg.placement and worker_view.cfg.placement.explorer.workers == 4
    assert current_placement(run.store, first.cfg)["lease_seconds"] == 60.0
    with pytest.raises(ConfigError, match=r"grpo.lr: 0.0002 \(started\) vs 0.5 \(now\)"):
        open_run(load_config(REPO / "configs/tiny.yaml", [*small_overrides, *moved, "grpo.lr=0.5"]))


def test_old_spellings_of_placement_are_read_as_placement():
    """Runs committed before placement had its own section (and old command lines) keep working."""
    old = load_config(None, ["exploration.workers=2", "exploration.worker_cpus=[1]", "exploration.lease_seconds=5",
                             "exploration.stall_seconds=9", "run.cpus=[0]"])
    assert old.placement.explorer.workers == 2 and old.placement.explorer.local_cpus == [1]
    assert (old.placement.lease_seconds, old.placement.stall_seconds, old.placement.trainer.local_cpus) == (5, 9, [0])
    with pytest.raises(ConfigError, match="exploration.workers .the old spelling. and placement.explorer.workers"):
        load_config(None, ["exploration.workers=2", "placement.explorer.workers=3"])
