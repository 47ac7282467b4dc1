"""Checkpoint retention: a long run keeps the newest policies and every keep_every-th, never one that
resume, exploration or evaluation still needs, and a pruned policy is reported as pruned, not missing."""

from __future__ import annotations

import pytest
import torch

from spotlight import stages
from spotlight.checkpoints import EMA, OPTIMIZER, POLICY, kept_objects
from spotlight.config import CheckpointSection, ConfigError, load_config
from spotlight.export import export_policy
from spotlight.run import open_run
from spotlight.store import StoreError
from tests.conftest import REPO, SMALL


def test_kept_objects_follow_the_settings():
    keep = CheckpointSection(keep_last=2, keep_every=3)
    newest = 7
    assert {s for s in range(newest + 1) if POLICY in kept_objects(keep, s, newest)} == {2, 5, 6, 7}
    assert all((EMA in kept_objects(keep, s, newest)) == (POLICY in kept_objects(keep, s, newest))
               for s in range(newest + 1)), "the EMA is kept with its policy: evaluation and export read it"
    assert {s for s in range(newest + 1) if OPTIMIZER in kept_objects(keep, s, newest)} == {newest}
    assert all(kept_objects(CheckpointSection(), s, newest) == {POLICY, EMA, OPTIMIZER} for s in range(newest + 1))


def test_keep_last_must_cover_the_stale_policy_exploration_reads():
    with pytest.raises(ConfigError, match="checkpoint.keep_last"):
        load_config(REPO / "configs/tiny.yaml", ["checkpoint.keep_last=1"])


def test_a_pruned_run_resumes_explores_and_evaluates(tmp_path, cache_url):
    """Also with ``grpo.ema``: the average is kept and pruned with its policy, evaluation scores it and
    export writes it (a full fine-tune here: the transformer with the average swapped in)."""
    sets = [*SMALL, "grpo.iterations=5", "exploration.mode=spotlight", "placement.explorer.workers=0",
            "exploration.candidates_per_prompt=4", "exploration.ranking_every=0", "checkpoint.keep_last=2",
            "checkpoint.keep_every=2", "grpo.ema={decay: 0.9, every: 2}", f"run.cache_url={cache_url}",
            f"run.url=file://{tmp_path}/run"]
    run = open_run(load_config(REPO / "configs/tiny.yaml", sets))
    stages.pretrain(run)
    for t in range(5):
        stages.explore(run, t)
        stages.update(run, t)
        stages.evaluate(run, t + 1)  # reads theta_{t+1}: the newest, always kept
    store = run.store
    commits = {t: store.load(f"iterations/{t:04d}/update") for t in range(5)}
    has = {t: {obj for obj in (POLICY, EMA, OPTIMIZER) if store.exists(c.key(obj))} for t, c in commits.items()}
    assert has == {0: set(), 1: {POLICY, EMA}, 2: set(), 3: {POLICY, EMA}, 4: {POLICY, EMA, OPTIMIZER}}
    assert store.sweep() == [], "every attempt object left is one a manifest names"
    assert store.pruned("iterations/0000/update")["objects"] == [EMA, OPTIMIZER, POLICY]
    assert store.load("evaluations/0005").json("metrics.json")["weights"] == "ema"
    # a fresh process resumes from the newest commit and explores with the stale one it needs
    resumed = open_run(load_config(REPO / "configs/tiny.yaml", [*sets, "grpo.iterations=5"]))
    assert resumed.policy_at(4) is not None and resumed.policy_at(5) is not None
    # an inference process loads the base once: an older instance is reused for a newer iteration
    reused = open_run(load_config(REPO / "configs/tiny.yaml", sets))
    first = reused.policy_at(2)
    assert reused.policy_at(4) is first, "theta_2's instance now holds theta_4"
    fresh = open_run(load_config(REPO / "configs/tiny.yaml", sets)).policy_at(4)
    assert all(torch.equal(a, b) for a, b in zip(first.trainable_state().values(), fresh.trainable_state().values()))
    with pytest.raises(StoreError, match=r"ema.safetensors was pruned by checkpoint retention \(keep_last=2"):
        export_policy(resumed, 3, tmp_path / "export")  # theta_3 = update(2)'s policy and its EMA
    assert export_policy(resumed, 4, tmp_path / "export")[0].name == "transformer"
    from diffusers import SD3Transformer2DModel

    exported = SD3Transformer2DModel.from_pretrained(tmp_path / "export" / "transformer").state_dict()
    average = store.load("iterations/0003/update").tensors(EMA)
    live = resumed.policy_state(4)
    assert all(torch.equal(exported[k], average[k]) for k in average), "export writes theta_4's EMA"
    assert any(not torch.equal(average[k], live[k]) for k in average), "which is not theta_4 itself"
    assert all(torch.equal(v, live[k]) for k, v in resumed.policy_at(4).trainable_state().items()), \
        "export swaps the policy's own weights back"

