"""Rewards served over HTTP: how people serve VLM, OCR or other heavy rewards next to the trainer.

Protocol (one request per batch of at most ``batch_size`` images, in order)::

    POST <url>
    Content-Type: application/json
    Authorization: Bearer <token>          # only when ``token_env`` is set

    {"prompts": ["a cat", ...], "images": ["<base64 PNG>", ...],
     "metadata": [{"prompt": "a cat", "tag": "single_object", ...}, ...]}   # only when the prompts have it

    200 OK
    {"scores": [0.73, ...]}                # one finite number per image, in the order sent

Images are 8-bit PNGs (RGB, or greyscale for one-channel policies) at the policy's resolution: the
image a user would save. ``metadata`` is sent when the run's prompts come from JSONL objects: each
image's prompt's object (null for a prompt without one), as flow_grpo hands its GenEval reward the
``tag`` and ``include`` fields of the prompt's line. Any other status than 200 is a failure: the
server's message (the JSON ``error``, ``detail`` or ``message`` field, else the body's text) is
reported with the URL and the status.
Connection errors, timeouts, 5xx and 429 (rate limited) are retried ``retries`` times with
exponential backoff; other 4xx are the request's fault and fail at once. A 200 whose body is not
``{"scores": [...]}`` with one finite number per image is a server bug and fails at once.

A minimal server (any framework works)::

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            images = [PIL.Image.open(io.BytesIO(base64.b64decode(b))) for b in body["images"]]
            scores = my_model.score(images, body["prompts"])  # e.g. a VLM judge or OCR accuracy
            data = json.dumps({"scores": [float(s) for s in scores]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

The bearer token is read from the environment once, sent only in the header, and replaced by
``***`` wherever a message could carry it (a server echoing it back included); exceptions are
never chained to an httpx exception (whose request holds the header).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import math
import os
import time
from typing import Any, Mapping, Sequence

import httpx
import numpy as np
import torch
from PIL import Image

from spotlight.config.base import ConfigError
from spotlight.config.rewards import RemoteRewardSection

_log = logging.getLogger(__name__)
_MESSAGE_CHARS = 500  # of a server's error message kept in ours


class RemoteRewardError(RuntimeError):
    """A remote reward failed: names the reward, its URL and what went wrong."""


def check_remote(name: str, section: RemoteRewardSection) -> None:
    """Preflight: the token's environment variable is set (the server itself is not called)."""
    if section.token_env and not os.environ.get(section.token_env):
        raise ConfigError(f"rewards.remote.{name}.token_env: environment variable {section.token_env} is not set "
                          f"(it holds the bearer token for {section.url})")


def png_base64(image: torch.Tensor) -> str:
    """[C, H, W] in [-1, 1] -> base64 of its 8-bit PNG (greyscale for C = 1)."""
    pixels = ((image.detach().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy()
    array = pixels[0] if pixels.shape[0] == 1 else np.ascontiguousarray(pixels.transpose(1, 2, 0))
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _server_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        for field in ("error", "detail", "message"):
            if field in body:
                return str(body[field])[:_MESSAGE_CHARS]
    return response.text.strip()[:_MESSAGE_CHARS] or response.reason_phrase


def _retryable(status: int) -> bool:
    return status >= 500 or status == 429


class RemoteReward:
    """Scores images by POSTing them to ``section.url`` (protocol in the module docstring); ``metadata``
    maps a prompt to the object sent with its images (``spotlight.prompts.prompt_metadata``)."""

    def __init__(self, name: str, section: RemoteRewardSection, backoff_seconds: float = 0.5,
                 metadata: Mapping[str, Any] | None = None):
        check_remote(name, section)
        self.name, self.section, self.backoff_seconds = name, section, backoff_seconds
        self.metadata = metadata or {}
        self._token = os.environ[section.token_env] if section.token_env else None
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        self._client = httpx.Client(timeout=section.timeout_seconds, headers=headers)

    def __repr__(self) -> str:
        return f"RemoteReward({self.name!r}, url={self.section.url!r}, token_env={self.section.token_env!r})"

    def _redact(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    def _describe(self, problem: str) -> str:
        return self._redact(f"remote reward {self.name!r} at {self.section.url}: {problem}")

    def _fail(self, problem: str) -> RemoteRewardError:
        return RemoteRewardError(self._describe(problem))

    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts")
        scores: list[float] = []
        size = self.section.batch_size
        for start in range(0, len(prompts), size):
            batch = list(prompts[start:start + size])
            payload: dict[str, Any] = {"prompts": batch,
                                       "images": [png_base64(image) for image in images[start:start + size]]}
            if self.metadata:
                payload["metadata"] = [self.metadata.get(prompt) for prompt in batch]
            scores += self._score(payload)
        return torch.tensor(scores, dtype=torch.float32)

    def _score(self, payload: dict) -> list[float]:
        attempts = self.section.retries + 1
        for attempt in range(1, attempts + 1):
            try:
                response = self._client.post(self.section.url, json=payload)
            except httpx.TimeoutException:
                problem = f"no response within timeout_seconds={self.section.timeout_seconds:g}"
            except httpx.TransportError as e:
                problem = f"connection failed ({type(e).__name__}: {e})"
            else:
                if response.is_success:
                    return self._parse(response, len(payload["images"]))
                problem = f"HTTP {response.status_code}: {_server_message(response)}"
                if not _retryable(response.status_code):
                    raise self._fail(problem)
            if attempt < attempts:
                delay = self.backoff_seconds * 2 ** (attempt - 1)
                _log.warning("%s; retry %d/%d in %.2g s", self._describe(problem), attempt, attempts - 1, delay)
                time.sleep(delay)
        raise self._fail(f"{problem} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})")

    def _parse(self, response: httpx.Response, expected: int) -> list[float]:
        try:
            body = response.json()
        except ValueError:
            raise self._fail(f"response is not JSON: {response.text[:200]!r}") from None
        scores = body.get("scores") if isinstance(body, dict) else None
        if not isinstance(scores, list):
            raise self._fail(f'response is not {{"scores": [...]}}: {json.dumps(body)[:200]}')
        if len(scores) != expected:
            raise self._fail(f"response has {len(scores)} scores for {expected} images")
        for i, score in enumerate(scores):
            if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
                raise self._fail(f"scores[{i}] is {score!r}, not a finite number")
        return [float(s) for s in scores]
