"""Reward runtimes (issue 6): parity, bucketing, refusal, auto + cache. Real torch/onnxruntime only."""

from __future__ import annotations

import tempfile
from collections import Counter

import fsspec
import pytest
import torch
from torch._dynamo.utils import counters

from spotlight import reward_runtime as rr
from spotlight.reward_models import VIT_TINY, build_vit

SHAPE = VIT_TINY.item_shape
CPU_RUNTIMES = [r for r in rr.RUNTIMES if rr.unavailable_reason(r, "cpu") is None]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_vit(VIT_TINY)


def eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def test_cpu_offers_the_expected_runtimes() -> None:
    assert set(CPU_RUNTIMES) == {"eager", "compile", "compile-max-autotune", "onnxruntime", "aoti"}


@pytest.mark.parametrize("runtime", CPU_RUNTIMES)
def test_runtime_matches_eager_on_a_padded_batch(model: torch.nn.Module, runtime: str) -> None:
    scorer = rr.make_scorer(model, SHAPE, runtime=runtime, batch_size=8)
    x = rr.seeded_batch(5, SHAPE, seed=7)
    out = scorer(x)
    assert scorer.runtime == runtime
    assert out.shape == (5, VIT_TINY.num_classes) and out.dtype == torch.float32
    assert rr.parity_error(out, eager(model, x)) <= 1e-5
    assert scorer.bucket_calls == Counter({8: 2})  # parity batch + batch 5 padded to 8


@pytest.mark.parametrize("runtime", ["eager", "onnxruntime"])
def test_only_a_runtime_that_writes_an_artifact_makes_a_folder(model: torch.nn.Module, runtime: str, tmp_path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed mid-run cannot remove its temporary folder: the eager scorer every run uses makes none."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    scorer = rr.make_scorer(model, SHAPE, runtime=runtime, batch_size=8)
    folders = list(tmp_path.glob(f"spotlight-{runtime}-*"))
    if runtime == "eager":
        assert folders == [] and scorer.artifact is None
    else:
        assert len(folders) == 1 and scorer.artifact.parent == folders[0] and scorer.artifact.suffix == ".onnx"


def test_compiled_runtime_does_not_recompile_within_a_bucket(model: torch.nn.Module) -> None:
    scorer = rr.make_scorer(model, SHAPE, runtime="compile", batch_size=8)
    scorer(rr.seeded_batch(5, SHAPE, seed=1))
    graphs = counters["stats"]["unique_graphs"]
    x3 = rr.seeded_batch(3, SHAPE, seed=2)
    out = scorer(x3)
    assert counters["stats"]["unique_graphs"] == graphs
    assert rr.parity_error(out, eager(model, x3)) <= 1e-5
    assert scorer.bucket_calls == Counter({8: 3})


def test_batches_beyond_the_largest_bucket_are_split(model: torch.nn.Module) -> None:
    scorer = rr.make_scorer(model, SHAPE, runtime="onnxruntime", batch_size=4, buckets=(4, 1))
    x = rr.seeded_batch(6, SHAPE, seed=3)
    out = scorer(x)
    assert out.shape[0] == 6
    assert rr.parity_error(out, eager(model, x)) <= 1e-5
    assert scorer.bucket_calls == Counter({4: 3})  # parity batch 4, then 6 = 4 + (2 padded to 4)


def test_unknown_runtime_lists_valid_names(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="'tensorrt'.*auto, eager, compile"):
        rr.make_scorer(model, SHAPE, runtime="tensorrt")


@pytest.mark.parametrize("runtime", ["compile-reduce-overhead", "onnxruntime-cuda"])
def test_cuda_only_runtime_is_refused_on_cpu_with_reason(model: torch.nn.Module, runtime: str) -> None:
    with pytest.raises(rr.RuntimeRefused, match="unavailable: .*cpu"):
        rr.make_scorer(model, SHAPE, runtime=runtime)


def _perturbed(builder, delta: float = 1e-3):
    """A real ONNX Runtime whose scores are off by `delta`: what a bad export would look like."""

    def build(ctx, workdir, artifact):
        run = builder(ctx, workdir, artifact)
        return lambda x: run(x) + delta

    return build


def test_runtime_failing_parity_is_refused(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(rr._BUILDERS, "onnxruntime", _perturbed(rr._BUILDERS["onnxruntime"]))
    with pytest.raises(rr.RuntimeRefused, match=r"'onnxruntime' refused: parity error 0.001 .* tolerance 1e-05"):
        rr.make_scorer(model, SHAPE, runtime="onnxruntime", batch_size=8)

    monkeypatch.setattr(rr, "AUTO_CANDIDATES", ("eager", "onnxruntime"))
    scorer = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=8)
    assert scorer.runtime == "eager"
    assert "parity error" in scorer.report["runtimes"]["onnxruntime"]["refused"]
    assert "median_ms" not in scorer.report["runtimes"]["onnxruntime"]


@pytest.mark.parametrize(("winner", "suffix"), [("onnxruntime", ".onnx"), ("aoti", ".pt2")])
def test_auto_caches_choice_and_artifact(model: torch.nn.Module, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                         winner: str, suffix: str) -> None:
    monkeypatch.setattr(rr, "AUTO_CANDIDATES", (winner,))  # a deterministic winner with an artifact
    url = f"file://{tmp_path}/cache"
    first = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=8, cache_url=url, model_name="tiny-vit")
    assert first.runtime == winner and first.report["from_cache"] is False
    assert first.report["runtimes"][winner]["median_ms"] > 0
    fs, root = fsspec.core.url_to_fs(first.report["cache_dir"])
    assert fs.exists(f"{root}/model{suffix}") and fs.exists(f"{root}/choice.json")

    def must_not_measure(*args, **kwargs):
        raise AssertionError("a cache hit must not re-measure")

    monkeypatch.setattr(rr, "measure_interleaved", must_not_measure)
    second = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=8, cache_url=url, model_name="tiny-vit")
    assert second.runtime == winner and second.report["from_cache"] is True
    assert second.report["runtimes"] == first.report["runtimes"]
    x = rr.seeded_batch(3, SHAPE, seed=4)
    assert rr.parity_error(second(x), eager(model, x)) <= 1e-5


def test_auto_cache_key_follows_the_weights(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rr, "AUTO_CANDIDATES", ("onnxruntime",))
    url = f"file://{tmp_path}/cache"
    a = rr.make_scorer(build_vit(VIT_TINY, seed=0), SHAPE, runtime="auto", batch_size=1, cache_url=url)
    b = rr.make_scorer(build_vit(VIT_TINY, seed=1), SHAPE, runtime="auto", batch_size=1, cache_url=url)
    assert b.report["from_cache"] is False and a.report["cache_dir"] != b.report["cache_dir"]


def test_corrupt_cached_artifact_is_re_measured_not_used(model: torch.nn.Module, tmp_path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rr, "AUTO_CANDIDATES", ("onnxruntime",))
    url = f"file://{tmp_path}/cache"
    first = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=1, cache_url=url)
    fs, root = fsspec.core.url_to_fs(first.report["cache_dir"])
    with fs.open(f"{root}/model.onnx", "wb") as f:
        f.write(b"not an onnx model")
    with pytest.warns(UserWarning, match="rejected, re-measuring"):
        again = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=1, cache_url=url)
    assert again.report["from_cache"] is False and again.runtime == "onnxruntime"


def test_auto_cache_works_on_s3(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for name, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "test",
                            "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(name, value)
        fs, _ = fsspec.core.url_to_fs("s3://reward-cache", skip_instance_cache=True)
        fs.mkdir("reward-cache")
        monkeypatch.setattr(rr, "AUTO_CANDIDATES", ("onnxruntime",))
        first = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=1, cache_url="s3://reward-cache/rt")
        second = rr.make_scorer(model, SHAPE, runtime="auto", batch_size=1, cache_url="s3://reward-cache/rt")
        assert first.report["from_cache"] is False and second.report["from_cache"] is True
        _, root = fsspec.core.url_to_fs(first.report["cache_dir"])
        assert fs.exists(f"{root}/model.onnx")
    finally:
        server.stop()


def test_vit_b16_matmul_flops_match_the_published_count():
    """The roofline's numerator: ViT-B/16 at 224 is 17.6 GMACs per image (Dosovitskiy et al.; timm)."""
    from spotlight.reward_models import VIT_B16

    assert abs(VIT_B16.forward_flops / 2 / 1e9 - 17.56) < 0.05
