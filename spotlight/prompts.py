"""Prompt sets, and which prompts an iteration trains on and evaluation scores.

A prompt set is the bundled digit classes (``digits``), one text file (one prompt per line), one
JSONL file (one object with a ``prompt`` field per line, or one JSON string), or a folder in
flow_grpo's layout (``train.txt``/``test.txt`` or ``train_metadata.jsonl``/``test_metadata.jsonl``).
A missing or empty set is a :class:`PromptError` naming the file, raised before any compute.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch

from spotlight.config import Config, ConfigError
from spotlight.data import DIGIT_PROMPTS
from spotlight.seeding import derive_seed, generator

Split = Literal["train", "test"]


class PromptError(ConfigError):
    """A prompt file that is missing, empty or malformed (names the file and line)."""


def prompt_file(spec: str, split: Split) -> Path:
    """The file holding ``split`` of the prompt set ``spec`` (a file is its own train split)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        for name in (f"{split}.txt", f"{split}_metadata.jsonl", f"{split}.jsonl"):
            if (path / name).is_file():
                return path / name
        raise PromptError(f"prompt folder {path} has no {split}.txt, {split}_metadata.jsonl or {split}.jsonl")
    if not path.is_file():
        raise PromptError(f"prompt file {path} does not exist")
    return path


@lru_cache(maxsize=8)
def read_prompts(path: Path) -> tuple[str, ...]:
    """Prompts of one file, in file order; blank lines are skipped."""
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{number}: not JSON ({e.msg})") from None
            value = value.get("prompt") if isinstance(value, dict) else value
            if not isinstance(value, str) or not value.strip():
                raise PromptError(f"{path}:{number}: expected a JSON string or an object with a \"prompt\" string")
            prompts.append(value.strip())
        else:
            prompts.append(line.strip())
    if not prompts:
        raise PromptError(f"prompt file {path} is empty")
    return tuple(prompts)


def train_prompts(cfg: Config) -> tuple[str, ...]:
    return DIGIT_PROMPTS if cfg.data.prompts == "digits" else read_prompts(prompt_file(cfg.data.prompts, "train"))


def heldout_prompts(cfg: Config) -> tuple[str, ...]:
    """Held-out prompts: ``data.eval_prompts``, else the set's test split (digits: the digit prompts)."""
    if cfg.data.eval_prompts is not None:
        prompts = read_prompts(prompt_file(cfg.data.eval_prompts, "test"))
    elif cfg.data.prompts == "digits":
        prompts = DIGIT_PROMPTS
    else:
        prompts = read_prompts(prompt_file(cfg.data.prompts, "test"))
    return prompts[: cfg.evaluation.prompts]


def iteration_prompts(cfg: Config, t: int) -> list[str]:
    """Iteration t's prompt groups: a seeded draw without replacement while the set lasts. Exploring
    modes draw ``extra_prompts`` more (unless they select seeds only), of which the filter keeps the most
    informative; the first ``prompts_per_iteration`` are the ones mode ``none`` trains on."""
    pool = train_prompts(cfg)
    g = generator(cfg.run.seed, "prompts", t)
    ec = cfg.exploration
    extra = ec.extra_prompts if ec.mode != "none" and ec.select != "seeds" else 0
    n = cfg.grpo.prompts_per_iteration + extra
    order = torch.cat([torch.randperm(len(pool), generator=g) for _ in range(-(-n // len(pool)))])
    return [pool[int(i)] for i in order[:n]]


def evaluation_prompts(cfg: Config) -> tuple[list[str], list[int]]:
    """Fixed across iterations: the same prompts and seeds score every theta_t (prompt-major order)."""
    prompts, seeds = [], []
    for i, prompt in enumerate(heldout_prompts(cfg)):
        for j in range(cfg.evaluation.seeds_per_prompt):
            prompts.append(prompt)
            seeds.append(derive_seed(cfg.run.seed, "eval", i, j))
    return prompts, seeds


def check_prompts(cfg: Config) -> None:
    """Fail early (PromptError naming the file) if the train or held-out prompts cannot be read."""
    train_prompts(cfg)
    heldout_prompts(cfg)
