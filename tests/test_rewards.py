"""Rewards that real runs use (issue 10, item 4): CLIP rewards against transformers' own computation,
the remote reward against a real HTTP server, and bad configs failing before compute. Offline."""

from __future__ import annotations

import base64
import io
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn import functional as F

from spotlight.clip_rewards import AestheticHead, ClipImagePreprocess, load_aesthetic_head, pil_resize_weights
from spotlight.config import Config, ConfigError, RemoteRewardSection, config_from_dict
from spotlight.models.tiny_clip import build_tiny_aesthetic_head, build_tiny_clip
from spotlight.remote_reward import RemoteReward, RemoteRewardError
from spotlight.rewards import RewardContext, WeightedReward, build_reward, check_rewards
from spotlight.store import RunStore
from tests.conftest import REPO

LEARNED = ("pickscore", "clip_score", "aesthetic")
# Policy image shapes: downscaled and cropped (non-square), upscaled grey digits, and the CLIP's own size.
SHAPES = [(3, 48, 40), (1, 16, 16), (3, 32, 32)]
# "the cat" twice (cached once); the random tiny CLIP happens to give "a house by the sea" and "A photo of a
# man" positive cosines, so CLIPScore (0 where cos < 0) has something to show.
PROMPTS = ["the cat", "a dog on the mat", "the cat", "a house by the sea", "a red car", "in the sky",
           "A photo of a man", "an apple"]

# PIL rounds to 8 bits after each resize pass; the torch preprocessing does not. Bound on that, in 8-bit
# levels: 0.5 * sum|bicubic weights| + 0.5 <= 1.25 (measured max 1.03, on white noise).
PIXEL_LEVELS_TOL = 1.25
# What that rounding does to the tiny CLIP's cosine (measured max 3.9e-4) and to the aesthetic head's
# score (measured max 3.0e-5); a reward's tolerance is its multiplier times the cosine's. Without a
# resize (policy images at the CLIP's size) there is no rounding: then scores agree within 1e-5
# (measured 1.3e-7).
COS_TOL, AESTHETIC_TOL, NO_RESIZE_TOL = 1e-3, 1e-4, 1e-5


# ------------------------------------------------------------------ learned rewards


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    build_tiny_aesthetic_head(root / "aesthetic-head.pth", dim=16)
    return build_tiny_clip(root / "tiny-clip", image_size=32)


def rewards_cfg(clip_dir: Path, train: dict[str, float], runtime: str = "eager") -> Config:
    return config_from_dict({
        "rewards": {"train": train, "runtime": runtime,
                    "pickscore": {"model": str(clip_dir)}, "clip_score": {"model": str(clip_dir)},
                    "aesthetic": {"clip_model": str(clip_dir), "head": str(clip_dir.parent / "aesthetic-head.pth")}},
        "grpo": {"prompts_per_iteration": 2, "group_size": 4},  # the scorer's parity batch: 8
    })


def context(cfg: Config, shape: tuple[int, int, int], tmp_path: Path) -> RewardContext:
    return RewardContext(cfg, torch.device("cpu"), RunStore(f"file://{tmp_path}/cache"), "unused", shape)


def policy_images(shape: tuple[int, ...], n: int = len(PROMPTS), seed: int = 0) -> torch.Tensor:
    """White noise in [-1, 1]: the hardest case for resampling."""
    return torch.rand((n, *shape), generator=torch.Generator().manual_seed(seed)) * 2 - 1


def as_pil(images: torch.Tensor) -> list[Image.Image]:
    """The 8-bit images flow_grpo hands its scorers."""
    pixels = ((images + 1) * 127.5).round().to(torch.uint8)
    return [Image.fromarray(p[0].numpy()) if p.shape[0] == 1 else Image.fromarray(p.permute(1, 2, 0).numpy())
            for p in pixels]


@pytest.fixture(scope="module")
def reference(clip_dir: Path) -> Callable[[str, torch.Tensor, list[str]], torch.Tensor]:
    """Each reward computed the plain transformers way: CLIPProcessor (PIL path) + get_*_features."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(clip_dir).eval()
    processor = CLIPProcessor.from_pretrained(clip_dir)
    head = AestheticHead(16)
    head.load_state_dict(torch.load(clip_dir.parent / "aesthetic-head.pth", weights_only=True))
    head.eval()

    def score(name: str, images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        with torch.no_grad():
            pixels = processor(images=as_pil(images), return_tensors="pt")["pixel_values"]
            image = F.normalize(model.get_image_features(pixel_values=pixels).pooler_output, dim=-1)
            if name == "aesthetic":
                return head(image).squeeze(-1)
            text = model.get_text_features(**processor.tokenizer(prompts, padding=True, return_tensors="pt"))
            cos = (image * F.normalize(text.pooler_output, dim=-1)).sum(-1)
        return model.logit_scale.exp() * cos / 26 if name == "pickscore" else 2.5 * cos.clamp_min(0)

    return score


@pytest.mark.parametrize("resample", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("sizes", [(37, 32), (16, 32), (100, 86), (512, 224)])
def test_resize_weights_are_pils_resize(resample: int, sizes: tuple[int, int]) -> None:
    """On float images (PIL mode F: no 8-bit rounding, no clipping) the matrices are PIL's resize."""
    n_in, n_out = sizes
    image = np.random.default_rng(0).random((n_in, n_in - 3), dtype=np.float32) * 255
    expected = np.asarray(Image.fromarray(image, mode="F").resize((n_out - 3, n_out), resample=resample))
    rows, cols = pil_resize_weights(n_in, n_out, resample), pil_resize_weights(n_in - 3, n_out - 3, resample)
    got = (rows @ torch.from_numpy(image).double() @ cols.T).numpy()
    assert np.abs(got - expected).max() < 1e-3  # levels of 255; PIL mode F stores float32


def test_unsupported_resample_is_named() -> None:
    with pytest.raises(ValueError, match="PIL resample filter 0 is not supported"):
        pil_resize_weights(64, 32, 0)


@pytest.mark.parametrize("shape", SHAPES)
def test_preprocessing_is_the_processors(clip_dir: Path, shape: tuple[int, int, int]) -> None:
    from transformers import CLIPImageProcessorPil, CLIPProcessor

    images = policy_images(shape)
    expected = CLIPProcessor.from_pretrained(clip_dir)(images=as_pil(images), return_tensors="pt")["pixel_values"]
    processor = CLIPImageProcessorPil.from_pretrained(clip_dir)
    got = ClipImagePreprocess(processor, shape)(images)
    assert got.shape == expected.shape == (len(images), 3, 32, 32)
    levels = ((got - expected).abs() * torch.tensor(processor.image_std).view(1, 3, 1, 1) * 255).max().item()
    assert levels <= (1e-3 if shape[1:] == (32, 32) else PIXEL_LEVELS_TOL)  # no resize: the same pixels


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", LEARNED)
def test_learned_reward_matches_transformers(clip_dir: Path, reference, tmp_path: Path, name: str,
                                             shape: tuple[int, int, int]) -> None:
    reward = build_reward(context(rewards_cfg(clip_dir, {name: 1.0}), shape, tmp_path), name)
    images = policy_images(shape)
    got, expected = reward(images, PROMPTS), reference(name, images, PROMPTS)
    assert got.shape == (len(PROMPTS),) and got.dtype == torch.float32
    tolerance = AESTHETIC_TOL if name == "aesthetic" else COS_TOL * reward.weight
    if shape[1:] == (32, 32):
        tolerance = NO_RESIZE_TOL
    assert (got - expected).abs().max().item() <= tolerance
    # Not constant: every (image, prompt) pair. The random CLIP's cosines are mostly < 0, where CLIPScore is 0.
    n = len(PROMPTS)
    grid = reward(images.repeat_interleave(n, 0), PROMPTS * n).view(n, n)
    assert grid[grid != 0].unique().numel() >= 3 and (grid.max() - grid.min()).item() > 10 * tolerance
    if name == "pickscore":  # 7 distinct prompts ("the cat" twice) give 7 scores per image
        assert torch.equal(grid[:, 0], grid[:, 2]) and all(row.unique().numel() == 7 for row in grid)
    if name == "aesthetic":  # prompts are not used; images differ
        assert (grid == grid[:, :1]).all() and grid[:, 0].unique().numel() == n
    else:
        assert len(reward.text.cache) == len(set(PROMPTS)), "one text embedding per distinct prompt"


@pytest.mark.parametrize("name", LEARNED)
def test_onnxruntime_scores_equal_eager(clip_dir: Path, tmp_path: Path, name: str) -> None:
    shape, images = (3, 48, 40), policy_images((3, 48, 40))
    eager = build_reward(context(rewards_cfg(clip_dir, {name: 1.0}), shape, tmp_path), name)
    onnx = build_reward(context(rewards_cfg(clip_dir, {name: 1.0}, runtime="onnxruntime"), shape, tmp_path), name)
    assert onnx.scorer.runtime == "onnxruntime" and onnx.scorer.artifact.suffix == ".onnx"
    assert (onnx(images, PROMPTS) - eager(images, PROMPTS)).abs().max().item() <= 1e-4  # measured <= 1.7e-7


def test_weighted_sum_is_the_weighted_components(clip_dir: Path, tmp_path: Path) -> None:
    cfg = rewards_cfg(clip_dir, {"pickscore": 1.0, "jpeg_compressibility": 0.5})
    ctx = context(cfg, (3, 48, 40), tmp_path)
    total = WeightedReward("train", {name: (w, build_reward(ctx, name)) for name, w in cfg.rewards.train.items()})
    images = policy_images((3, 48, 40))
    pickscore = build_reward(ctx, "pickscore")(images, PROMPTS)
    jpeg = build_reward(ctx, "jpeg_compressibility")(images, PROMPTS)
    assert torch.allclose(total(images, PROMPTS), 1.0 * pickscore + 0.5 * jpeg, atol=1e-6, rtol=0)
    assert set(total.components(images, PROMPTS)) == {"pickscore", "jpeg_compressibility"}


def test_aesthetic_head_loads_safetensors_and_checks_its_layout(clip_dir: Path, tmp_path: Path) -> None:
    torch_head = load_aesthetic_head(clip_dir.parent / "aesthetic-head.pth", 16)
    same = load_aesthetic_head(build_tiny_aesthetic_head(tmp_path / "head.safetensors", 16), 16)
    embeds = F.normalize(torch.randn(4, 16), dim=-1)
    assert torch.equal(torch_head(embeds), same(embeds))
    with pytest.raises(ValueError, match=r"takes 768-dim CLIP embeddings, but the CLIP model .* makes 16-dim"):
        load_aesthetic_head(build_tiny_aesthetic_head(tmp_path / "l14.pth", 768), 16)
    torch.save({"weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="is not a LAION aesthetic head"):
        load_aesthetic_head(tmp_path / "other.pth", 16)


# ------------------------------------------------------------------ remote reward


class ScriptedServer(ThreadingHTTPServer):
    """A real HTTP server on 127.0.0.1 whose replies a test scripts; it records every request."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[dict[str, Any]] = []
        self.reply: Callable[[int, dict], tuple[int, bytes]] = lambda index, body: (200, scores_of(body))
        self.release = threading.Event()  # set to end a hanging reply

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/score"


class _Handler(BaseHTTPRequestHandler):
    server: ScriptedServer

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append({"body": body, "authorization": self.headers.get("Authorization")})
        status, data = self.server.reply(len(self.server.requests) - 1, body)
        if status == 0:  # hang
            self.server.release.wait(10)
            return
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:  # keep test output clean
        pass


def decode(png: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(png))))


def scores_of(body: dict) -> bytes:
    """Score = 1000 * the prompt's number + the image's mean 8-bit value: order is checkable."""
    return json.dumps({"scores": [1000 * int(p[1:]) + float(decode(img).mean())
                                  for p, img in zip(body["prompts"], body["images"])]}).encode()


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    srv = ScriptedServer()
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield srv
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def remote(server_url: str, **options: Any) -> RemoteReward:
    section = RemoteRewardSection(url=server_url, **{"timeout_seconds": 5.0, "retries": 3, **options})
    return RemoteReward("judge", section, backoff_seconds=0.01)


def flat_images(n: int, shape: tuple[int, int, int] = (3, 12, 10)) -> torch.Tensor:
    """Image i is flat at 8-bit level 10 * i."""
    return torch.stack([torch.full(shape, 10 * i / 127.5 - 1) for i in range(n)])


def test_remote_scores_come_back_in_order_across_batches(server: ScriptedServer) -> None:
    prompts = [f"p{i}" for i in range(8)]
    got = remote(server.url, batch_size=3)(flat_images(8), prompts)
    assert got.tolist() == [1000 * i + 10 * i for i in range(8)]
    assert [len(r["body"]["images"]) for r in server.requests] == [3, 3, 2]
    assert [r["body"]["prompts"] for r in server.requests] == [prompts[:3], prompts[3:6], prompts[6:]]
    assert decode(server.requests[0]["body"]["images"][1]).shape == (12, 10, 3)  # an RGB PNG at policy size
    grey = remote(server.url)(flat_images(2, (1, 16, 16)), ["p0", "p1"])
    assert grey.tolist() == [0.0, 1010.0] and decode(server.requests[-1]["body"]["images"][0]).shape == (16, 16)

    assert all("metadata" not in r["body"] for r in server.requests), "prompts without metadata send none"


def test_remote_sends_each_images_prompt_metadata(server: ScriptedServer, tmp_path: Path) -> None:
    """GenEval's lines (flow_grpo's dataset/geneval layout): each image goes out with its prompt's object."""
    from spotlight.config import load_config
    from spotlight.prompts import prompt_metadata

    lines = [{"tag": "single_object", "include": [{"class": "bench", "count": 1}], "prompt": "p0"},
             {"tag": "counting", "include": [{"class": "cup", "count": 3}], "exclude": [{"class": "cup", "count": 4}],
              "prompt": "p1"},
             {"tag": "colors", "include": [{"class": "car", "count": 1, "color": "red"}], "prompt": "p2"}]
    (tmp_path / "train_metadata.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines[:2]))
    (tmp_path / "test_metadata.jsonl").write_text(json.dumps(lines[2]) + "\n")
    cfg = load_config(REPO / "configs/sd35m-pickscore.yaml", [  # docs/real_models.md's GenEval command
        f"data.prompts={tmp_path}", "rewards.train={geneval: 1.0}", "rewards.eval={geneval: 1.0}",
        f"rewards.remote.geneval.url={server.url}", "rewards.remote.geneval.batch_size=2"])
    check_rewards(cfg)
    reward = RemoteReward("geneval", cfg.rewards.remote["geneval"], metadata=prompt_metadata(cfg))
    got = reward(flat_images(5), ["p1", "p0", "p2", "p1", "p9"])
    assert got.tolist() == [1000, 10, 2020, 1030, 9040]
    assert [r["body"]["metadata"] for r in server.requests] == [[lines[1], lines[0]], [lines[2], lines[1]], [None]]


def test_remote_retries_server_errors(server: ScriptedServer) -> None:
    server.reply = lambda i, body: (503, b'{"error": "warming up"}') if i < 2 else (200, scores_of(body))
    assert remote(server.url, retries=2)(flat_images(2), ["p0", "p1"]).tolist() == [0.0, 1010.0]
    assert len(server.requests) == 3
    server.requests.clear()
    server.reply = lambda i, body: (503, b'{"error": "warming up"}')
    with pytest.raises(RemoteRewardError) as err:
        remote(server.url, retries=2)(flat_images(2), ["p0", "p1"])
    assert f"'judge' at {server.url}: HTTP 503: warming up (gave up after 3 attempts)" in str(err.value)
    assert len(server.requests) == 3


def test_remote_client_error_fails_at_once_with_the_servers_message(server: ScriptedServer) -> None:
    server.reply = lambda i, body: (400, b'{"detail": "prompt too long"}')
    with pytest.raises(RemoteRewardError, match=f"at {server.url}: HTTP 400: prompt too long$"):
        remote(server.url)(flat_images(1), ["p0"])
    assert len(server.requests) == 1, "a 4xx is not retried"


def test_remote_hanging_server_times_out(server: ScriptedServer) -> None:
    server.reply = lambda i, body: (0, b"")
    with pytest.raises(RemoteRewardError) as err:
        remote(server.url, timeout_seconds=0.2, retries=1)(flat_images(1), ["p0"])
    assert str(err.value) == (f"remote reward 'judge' at {server.url}: no response within timeout_seconds=0.2 "
                              "(gave up after 2 attempts)")
    assert len(server.requests) == 2


def test_remote_unreachable_server_is_retried_then_named() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/score"
    with pytest.raises(RemoteRewardError, match=f"at {url}: connection failed .* \\(gave up after 2 attempts\\)"):
        remote(url, retries=1)(flat_images(1), ["p0"])


@pytest.mark.parametrize("data, needle", [
    (b"<html>oops</html>", "response is not JSON: '<html>oops</html>'"),
    (b'{"score": [1.0, 2.0]}', 'response is not {"scores": [...]}'),
    (b'{"scores": [1.0]}', "response has 1 scores for 2 images"),
    (b'{"scores": [1.0, "high"]}', "scores[1] is 'high', not a finite number"),
    (b'{"scores": [NaN, 1.0]}', "scores[0] is nan, not a finite number"),
])
def test_remote_malformed_response_fails_clearly(server: ScriptedServer, data: bytes, needle: str) -> None:
    server.reply = lambda i, body: (200, data)
    with pytest.raises(RemoteRewardError) as err:
        remote(server.url)(flat_images(2), ["p0", "p1"])
    assert needle in str(err.value) and server.url in str(err.value)
    assert len(server.requests) == 1, "a malformed answer is a server bug: not retried"


def test_remote_bearer_token_is_sent_and_never_shown(server: ScriptedServer, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    token = "s3cr3t-t0ken-value"
    monkeypatch.setenv("JUDGE_TOKEN", token)
    # The server echoes the header back in its errors: the worst case for a leak.
    def echo(i: int, body: dict) -> tuple[int, bytes]:
        return 503 if i == 0 else 401, json.dumps({"error": f"bad {server.requests[i]['authorization']}"}).encode()

    server.reply = echo
    reward = remote(server.url, token_env="JUDGE_TOKEN", retries=1)
    with caplog.at_level(logging.WARNING), pytest.raises(RemoteRewardError) as err:
        reward(flat_images(1), ["p0"])
    assert [r["authorization"] for r in server.requests] == [f"Bearer {token}"] * 2
    assert "HTTP 401: bad Bearer ***" in str(err.value) and "HTTP 503: bad Bearer ***" in caplog.text
    assert err.value.__cause__ is None and err.value.__context__ is None
    for text in (str(err.value), repr(err.value), caplog.text, repr(reward)):
        assert token not in text


def test_remote_token_variable_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JUDGE_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="environment variable JUDGE_TOKEN is not set"):
        remote("http://127.0.0.1:9/score", token_env="JUDGE_TOKEN")


# ------------------------------------------------------------------ bad input, before any compute


@pytest.mark.parametrize("rewards, needle", [
    ({"train": "nope"}, "train: unknown reward 'nope'; known rewards: aesthetic, clip_score, digit_classifier, "
                        "heldout_classifier, jpeg_compressibility, pickscore"),
    ({"train": {"pickscore": "abc"}, "pickscore": {"model": "m"}},
     "rewards.train.pickscore: Input should be a valid number"),
    ({"train": {"pickscore": 1.0}}, "reward 'pickscore' needs its weights: set rewards.pickscore"),
    ({"eval": "aesthetic"}, "reward 'aesthetic' needs its weights: set rewards.aesthetic"),
    ({"train": {"clip_score": 1.0}, "clip_score": {}}, "rewards.clip_score.model: Field required"),
])
def test_bad_reward_config_is_named(rewards: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"rewards": rewards})
    assert needle in str(err.value)


def missing_path_cases(clip: Path) -> list[tuple[dict, str]]:
    head = str(clip.parent / "aesthetic-head.pth")
    return [
        ({"pickscore": {"model": "/nowhere/PickScore_v1"}},
         "reward 'pickscore': rewards.pickscore.model: /nowhere/PickScore_v1 does not exist"),
        ({"pickscore": {"model": str(clip), "processor": "/nowhere/CLIP-ViT-H-14"}},
         "rewards.pickscore.processor: /nowhere/CLIP-ViT-H-14 does not exist"),
        ({"clip_score": {"model": str(clip.parent)}},
         f"rewards.clip_score.model: {clip.parent / 'config.json'} is missing"),
        ({"aesthetic": {"clip_model": str(clip), "head": str(clip.parent / "sac+logos+ava1-l14-linearMSE.pth")}},
         f"rewards.aesthetic.head: {clip.parent / 'sac+logos+ava1-l14-linearMSE.pth'} does not exist"),
        ({"aesthetic": {"clip_model": "/nowhere/clip-vit-large-patch14", "head": head}},
         "rewards.aesthetic.clip_model: /nowhere/clip-vit-large-patch14 does not exist"),
    ]


@pytest.mark.parametrize("case", range(5))
def test_missing_weights_are_named_before_compute(clip_dir: Path, case: int) -> None:
    section, needle = missing_path_cases(clip_dir)[case]
    name = next(iter(section))
    cfg = config_from_dict({"rewards": {"train": {name: 1.0}, **section}})
    with pytest.raises(ConfigError) as err:
        check_rewards(cfg)
    assert needle in str(err.value)


def test_preflight_checks_weights_files_and_tokens(clip_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    check_rewards(rewards_cfg(clip_dir, {"pickscore": 1.0, "clip_score": 0.5, "aesthetic": 0.1}))  # all present
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((clip_dir / "config.json").read_text())
    monkeypatch.delenv("OCR_TOKEN", raising=False)
    cfg = config_from_dict({"rewards": {
        "train": {"pickscore": 1.0, "ocr": 1.0}, "pickscore": {"model": str(no_weights)},
        "remote": {"ocr": {"url": "http://127.0.0.1:9/ocr", "token_env": "OCR_TOKEN"}}}})
    with pytest.raises(ConfigError) as err:
        check_rewards(cfg)
    assert f"reward 'pickscore': rewards.pickscore.model: {no_weights} has no weights" in str(err.value)
    assert "reward 'ocr': rewards.remote.ocr.token_env: environment variable OCR_TOKEN is not set" in str(err.value)
    monkeypatch.setenv("OCR_TOKEN", "x")
    with pytest.raises(ConfigError) as err:
        check_rewards(cfg)
    assert "OCR_TOKEN" not in str(err.value), "the remote reward passes once its token is set"
