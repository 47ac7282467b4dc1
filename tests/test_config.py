"""Bad input fails before any compute, with a message that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spotlight.config import ConfigError, load_config
from tests.conftest import REPO, run_cli, spotlight_cmd


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
])
def test_bad_values_are_named(override, needle):
    with pytest.raises(ConfigError) as err:
        load_config(REPO / "configs/tiny.yaml", [override])
    assert needle in str(err.value)


def test_unknown_key_in_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo:\n  iterations: 2\n  gruop_size: 4\n")
    with pytest.raises(ConfigError, match=r"grpo.gruop_size: unknown key"):
        load_config(bad)


@pytest.mark.parametrize("override, needle", [
    ("grpo.group_size=0", "group size must be >= 2"),
    ("rewards.train=nope", "unknown reward 'nope'"),
    ("grpo.bogus=1", "grpo.bogus: unknown key"),
    *([("run.device=cuda", "run.device is 'cuda' but torch")] if not torch.cuda.is_available() else []),
])
def test_cli_fails_before_any_compute(tmp_path: Path, override, needle):
    result = run_cli(spotlight_cmd("run", overrides=[override, f"run.url=file://{tmp_path}/run"]), tmp_path, 120)
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
