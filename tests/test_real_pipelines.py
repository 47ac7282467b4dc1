"""The real-model path end to end: tiny random-weight SD3, FLUX and Qwen-Image pipelines, saved with
``save_pretrained`` and loaded through ``model.kind`` + ``model.pretrained`` by the shipped configs
(configs/sd35m-pickscore.yaml, flux-dev-ocr.yaml, qwen-image-pickscore.yaml, shrunk by overrides).

Each runs a complete 2-iteration spotlight run through the CLI and the Prefect flow: exploration by
a worker process, filter, LoRA update with guidance > 1 (true CFG for SD3 and Qwen-Image, FLUX-dev's
guidance embedding), evaluation, then ``spotlight export``, whose LoRA loaded into the diffusers
pipeline samples what the policy samples. The SD3 run is also killed with -9 at random points and
resumed: the final adapter, its EMA and the optimizer state are bit-identical to the undisturbed run.
The SD3 and FLUX configs keep flow_grpo's EMA of the adapter (updated every step here, not every 8, so
that 4 optimizer steps move it): evaluation scores it and export writes it.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from spotlight.ema import ema_state
from spotlight.cli import print_summary
from spotlight.models.export import pipeline_class
from spotlight.models.tiny_clip import build_tiny_clip
from spotlight.models.tiny_pipelines import build_tiny_pipeline
from spotlight.run import open_run_from_url
from spotlight.sampler import sample_ode
from spotlight.seeding import draw, rollout_generators
from spotlight.report import Summary
from spotlight.store import RunStore, bytes_to_tensors
from tests.conftest import REPO, SPOTLIGHT, cli_env, run_cli
from tests.test_pipelines import pipeline_sample

CONFIGS = {"sd3": "sd35m-pickscore.yaml", "flux": "flux-dev-ocr.yaml", "qwen-image": "qwen-image-pickscore.yaml"}
FINAL = "iterations/0001/update"
SHRINK = [  # the shipped configs at toy size, on one core
    "run.threads=1", "model.resolution=32", "model.max_sequence_length=16", "model.lora.rank=4",
    "model.lora.alpha=8", "sampler.train_steps=4", "sampler.eval_steps=4", "sampler.batch_size=8",
    "grpo.iterations=2", "grpo.prompts_per_iteration=2", "grpo.group_size=4", "grpo.optimizer_steps=2",
    "grpo.microbatch_size=8", "exploration.candidates_per_prompt=8", "exploration.max_candidates_per_prompt=16",
    "exploration.seeds_per_batch=4", "exploration.extra_prompts=1", "placement.explorer.workers=1",
    "placement.lease_seconds=30", "placement.stall_seconds=120", "exploration.ranking_every=0",
    "evaluation.every=1", "evaluation.seeds_per_prompt=2", "evaluation.prompts=2", "rewards.runtime=eager",
]
TRAIN = ["a red cat on a mat", "a blue car", "two dogs in the snow", "a sign that says OPEN", "a green apple",
         "a photo of a castle"]
TEST = ["a yellow bird", "a cup of tea"]
# FLUX's prompts as flow_grpo's GenEval set is laid out (dataset/geneval/{train,test}_metadata.jsonl):
# one object per prompt, whose fields an HTTP reward receives beside the image
def geneval_tag(prompt: str) -> str:
    colored = {"red", "blue", "green", "yellow"} & set(prompt.split())
    return "counting" if prompt.startswith("two ") else "colors" if colored else "single_object"


METADATA = {prompt: {"tag": geneval_tag(prompt), "include": [{"class": prompt.split()[-1], "count": 1}], "prompt": prompt}
            for prompt in TRAIN + TEST}


class BrightnessOCR(BaseHTTPRequestHandler):
    """Stands in for an OCR model behind HTTP: the real protocol, a cheap score (mean brightness)."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        import base64
        import io

        import numpy as np
        from PIL import Image

        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append({key: body[key] for key in ("prompts", "metadata") if key in body})
        scores = [float(np.asarray(Image.open(io.BytesIO(base64.b64decode(img)))).mean() / 255)
                  for img in body["images"]]
        data = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict[str, Path | str]:
    """Tiny pipelines, a tiny CLIP (PickScore stand-in), a prompt folder and an OCR server, built offline."""
    root = tmp_path_factory.mktemp("real-path")
    prompts = root / "prompts"
    prompts.mkdir()
    (prompts / "train.txt").write_text("\n".join(TRAIN) + "\n")
    (prompts / "test.txt").write_text("\n".join(TEST) + "\n")
    with_metadata = root / "prompts-metadata"
    with_metadata.mkdir()
    for split, lines in (("train", TRAIN), ("test", TEST)):
        (with_metadata / f"{split}_metadata.jsonl").write_text("".join(json.dumps(METADATA[p]) + "\n" for p in lines))
    server = ThreadingHTTPServer(("127.0.0.1", 0), BrightnessOCR)
    server.bodies = []  # what the OCR server was sent, less the images
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield {**{kind: build_tiny_pipeline(kind, root / kind) for kind in CONFIGS}, "clip": build_tiny_clip(root / "clip"),
           "prompts": prompts, "prompts-metadata": with_metadata, "ocr": f"http://127.0.0.1:{server.server_port}/score",
           "ocr-bodies": server.bodies, "cache": root / "cache"}
    server.shutdown()


def overrides(kind: str, parts: dict, run: Path) -> list[str]:
    prompts = parts["prompts-metadata" if kind == "flux" else "prompts"]
    sets = [*SHRINK, f"model.pretrained={parts[kind]}", f"data.prompts={prompts}", f"run.url=file://{run}",
            f"run.cache_url=file://{parts['cache']}"]
    if kind != "qwen-image":
        sets.append("grpo.ema.every=1")
    if kind == "flux":
        sets.append(f"rewards.remote.ocr.url={parts['ocr']}")
    else:
        sets += [f"rewards.pickscore.model={parts['clip']}", "rewards.pickscore.processor=null"]
    return sets


def run_command(kind: str, sets: list[str]) -> list[str]:
    return [SPOTLIGHT, "run", "--config", str(REPO / "configs" / CONFIGS[kind]), *[a for s in sets for a in ("--set", s)]]


@pytest.fixture(scope="module")
def runs(parts, tmp_path_factory) -> dict[str, Path]:
    """One complete 2-iteration spotlight run per pipeline kind."""
    out = {}
    for kind in CONFIGS:
        work = tmp_path_factory.mktemp(kind)
        result = run_cli(run_command(kind, overrides(kind, parts, work / "run")), work, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[kind] = work / "run"
    return out


@pytest.mark.parametrize("kind", CONFIGS)
def test_spotlight_run_explores_trains_a_lora_with_guidance_and_evaluates(kind, runs):
    store = RunStore(f"file://{runs[kind]}")
    cfg = open_run_from_url(store.url).cfg
    assert cfg.model.kind == kind and cfg.sampler.guidance > 1 and cfg.exploration.mode == "spotlight"
    for t in range(2):
        stats = store.load(f"iterations/{t:04d}/explore").json("stats.json")
        assert stats["candidates"] >= 2 * 4 and stats["policy_iteration"] == max(t - 1, 0)
        metrics = store.load(f"iterations/{t:04d}/update").json("metrics.json")
        assert metrics["first_log_ratio"] <= 1e-6, "rollout and training see one policy (ratio 1)"
        assert metrics["prompts_trained"] == 2 and metrics["optimizer_steps"] == 2
    assert any(name.startswith("local-explorer-") for name in store.list("workers")), "an explorer process ran"
    evals = [store.load(f"evaluations/{t:04d}").json("metrics.json") for t in range(3)]
    assert [e["prompts"] for e in evals] == [TEST] * 3
    assert evals[2]["weights"] == ("live" if kind == "qwen-image" else "ema")
    assert evals[0]["eval_reward"] != evals[2]["eval_reward"], "the policy moved"


def test_an_http_reward_receives_each_prompts_metadata(parts, runs):
    """FLUX's run reads GenEval-style JSONL; every request to its OCR server (explorer, trainer, evaluation)
    carries, for each image, the object of the image's prompt."""
    bodies = parts["ocr-bodies"]
    scored = {p for body in bodies for p in body["prompts"]}
    assert set(TEST) <= scored and scored & set(TRAIN) and scored <= set(TRAIN + TEST)
    assert all(body["metadata"] == [METADATA[p] for p in body["prompts"]] for body in bodies)


def test_evaluation_and_report_give_the_held_out_reward_per_tag(runs, capsys, monkeypatch):
    """GenEval's score is the mean over its tasks: each evaluation records the reward of each tag's prompts."""
    store = RunStore(f"file://{runs['flux']}")
    last = store.load("evaluations/0002").json("metrics.json")
    assert [geneval_tag(p) for p in TEST] == ["colors", "single_object"]
    assert last["eval_reward_by_tag"] == dict(zip(["colors", "single_object"], last["eval_reward_per_prompt"]))
    summary = json.loads(store.read_bytes("report/summary.json"))
    assert summary["eval_reward_by_tag"][-1] == [2, last["eval_reward_by_tag"]]
    monkeypatch.setenv("COLUMNS", "200")  # one table row per line
    print_summary(Summary(**summary))
    colors, single = last["eval_reward_by_tag"]["colors"], last["eval_reward_by_tag"]["single_object"]
    printed = " ".join(capsys.readouterr().out.split())
    assert (f"held-out reward by tag, theta_2 │ colors {colors:.3f}, single_object {single:.3f} "
            f"(mean of the tags {(colors + single) / 2:.3f})") in printed
    sd3 = RunStore(f"file://{runs['sd3']}").load("evaluations/0002").json("metrics.json")
    assert "eval_reward_by_tag" not in sd3, "a text prompt file has no tags"


@pytest.mark.parametrize("kind", CONFIGS)
def test_the_store_commits_only_the_adapter(kind, runs):
    commit = RunStore(f"file://{runs[kind]}").load(FINAL)
    policy = bytes_to_tensors(commit.read("policy.safetensors"))
    core = open_run_from_url(f"file://{runs[kind]}").policy_at(0).core
    adapter = [p for name, p in core.named_parameters() if "lora_" in name]
    adapter_bytes = sum(p.numel() for p in adapter) * 4
    assert policy and all(".lora_A." in k or ".lora_B." in k for k in policy)
    assert sum(t.numel() * t.element_size() for t in policy.values()) == adapter_bytes
    if kind == "qwen-image":  # flow_grpo's targets: both streams' MLP projections too
        for target in ("img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2"):
            assert any(f".{target}.lora_A." in k for k in policy), target
    else:  # the EMA is an adapter too: same keys and bytes
        ema = bytes_to_tensors(commit.read("ema.safetensors"))
        assert ema.keys() == policy.keys() and any(not torch.equal(ema[k], policy[k]) for k in ema)
    header = 16 * 1024  # safetensors' JSON header: names, shapes, offsets
    assert commit.manifest["objects"]["policy.safetensors"]["size"] < adapter_bytes + header
    # AdamW keeps two moments per adapter parameter: the optimizer state is the adapter's size twice
    assert commit.manifest["objects"]["optimizer.safetensors"]["size"] < 2 * adapter_bytes + 2 * header


@pytest.mark.parametrize("kind", CONFIGS)
def test_export_loads_into_the_pipeline_and_samples_what_the_policy_samples(kind, runs, tmp_path):
    out = tmp_path / "export"
    result = run_cli([SPOTLIGHT, "export", "--run", f"file://{runs[kind]}", "--iteration", "2", "--out", str(out)],
                     tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    card = (out / "README.md").read_text()
    assert "theta_2" in card and "held-out reward" in card and f"kind: {kind}" in card
    run = open_run_from_url(f"file://{runs[kind]}")
    policy, cfg = run.policy_at(2), run.cfg
    if cfg.grpo.ema is not None:  # what was exported: theta_2's EMA
        policy.load_trainable_state(ema_state(run, 2))
    pipe = pipeline_class(kind).from_pretrained(cfg.model.pretrained)
    pipe.load_lora_weights(out)
    pipe.set_progress_bar_config(disable=True)
    seeds, prompts = [5, 9], TEST
    x0 = draw(rollout_generators(seeds), policy.latent_shape)
    ours = sample_ode(policy, prompts, seeds, 4, cfg.sampler.guidance, cfg.sampler.negative_prompt, decode=False)
    theirs = pipeline_sample(pipe, kind, x0, cfg.sampler.guidance, "latent", prompts=prompts, steps=4,
                             negative=cfg.sampler.negative_prompt, max_sequence_length=cfg.model.max_sequence_length)
    torch.testing.assert_close(theirs.float(), ours, rtol=1e-5, atol=1e-5)
    base = sample_ode(run.policy_at(0), prompts, seeds, 4, cfg.sampler.guidance, cfg.sampler.negative_prompt,
                      decode=False)
    assert (base - ours).abs().max() > 1e-4, "the exported adapter is not the identity"


def test_kill_9_anywhere_then_resume_is_bit_identical(parts, runs, tmp_path):
    reference = runs["sd3"]
    killed = tmp_path / "killed"
    sets = overrides("sd3", parts, killed)
    rng = random.Random(7)
    total = sum(1 for _ in reference.rglob("COMMIT.json"))
    kills = 0
    for commits in sorted(rng.sample(range(2, total - 1), 3)):
        proc = subprocess.Popen(run_command("sd3", sets), cwd=tmp_path, env=cli_env(tmp_path),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        while proc.poll() is None and sum(1 for _ in killed.rglob("COMMIT.json")) < commits:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        if proc.poll() is not None:
            break
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        kills += 1
    result = run_cli(run_command("sd3", sets), tmp_path, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert kills >= 2, f"the test must actually kill runs (killed {kills} times)"
    for obj in ("policy.safetensors", "ema.safetensors", "optimizer.safetensors"):
        assert RunStore(f"file://{killed}").load(FINAL).read(obj) == RunStore(f"file://{reference}").load(FINAL).read(obj)
