"""Prompt sets, and which prompts an iteration trains on and evaluation scores.

A prompt set is the bundled digit classes (``digits``), one text file (one prompt per line), one
JSONL file (one object with a ``prompt`` field per line, or one JSON string), or a folder in
flow_grpo's layout (``train.txt``/``test.txt`` or ``train_metadata.jsonl``/``test_metadata.jsonl``).
A missing or empty set is a :class:`PromptError` naming the file, raised before any compute.

A JSONL object is also its prompt's metadata, as in flow_grpo, whose GenEval reward scores an image
against its line's ``tag`` and ``include`` objects: HTTP rewards receive it beside the prompt
(:func:`prompt_metadata`, ``spotlight.remote_reward``). Runs name prompts by their text, so a prompt
that appears twice must carry the same object both times.
"""

from __future__ import annotations

import json
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from statistics import fmean
from typing import Any, Literal, Sequence

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
def read_lines(path: Path) -> tuple[tuple[int, str, str | None], ...]:
    """(line number, prompt, its JSONL object as JSON text or None) per prompt, in file order; blank lines
    are skipped. The objects stay text so that the cached value cannot be changed by a caller."""
    lines = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{number}: not JSON ({e.msg})") from None
            prompt = value.get("prompt") if isinstance(value, dict) else value
            if not isinstance(prompt, str) or not prompt.strip():
                raise PromptError(f"{path}:{number}: expected a JSON string or an object with a \"prompt\" string")
            lines.append((number, prompt.strip(), json.dumps(value) if isinstance(value, dict) else None))
        else:
            lines.append((number, line.strip(), None))
    if not lines:
        raise PromptError(f"prompt file {path} is empty")
    return tuple(lines)


def read_prompts(path: Path) -> tuple[str, ...]:
    """Prompts of one file, in file order."""
    return tuple(prompt for _, prompt, _ in read_lines(path))


def split_file(cfg: Config, split: Split) -> Path | None:
    """The file holding a split of the run's prompts (None: the bundled digits). Held-out prompts are
    ``data.eval_prompts`` when set, else the prompt set's test split."""
    if split == "test" and cfg.data.eval_prompts is not None:
        return prompt_file(cfg.data.eval_prompts, "test")
    return None if cfg.data.prompts == "digits" else prompt_file(cfg.data.prompts, split)


def train_prompts(cfg: Config) -> tuple[str, ...]:
    path = split_file(cfg, "train")
    return DIGIT_PROMPTS if path is None else read_prompts(path)


def heldout_prompts(cfg: Config) -> tuple[str, ...]:
    """The first ``evaluation.prompts`` of the held-out split (digits: the digit prompts)."""
    path = split_file(cfg, "test")
    return (DIGIT_PROMPTS if path is None else read_prompts(path))[: cfg.evaluation.prompts]


def prompt_metadata(cfg: Config) -> dict[str, dict[str, Any]]:
    """Each prompt's JSONL object, over the train and held-out files (empty for text files and digits).
    A prompt given two different objects is a PromptError naming both lines."""
    first: dict[str, tuple[dict[str, Any], str]] = {}  # prompt -> (its object, where it was first seen)
    for path in dict.fromkeys(p for p in (split_file(cfg, "train"), split_file(cfg, "test")) if p is not None):
        for number, prompt, text in read_lines(path):
            if text is None:
                continue
            value = json.loads(text)
            seen, where = first.setdefault(prompt, (value, f"{path}:{number}"))
            if seen != value:
                raise PromptError(f"{path}:{number}: prompt {prompt!r} has other metadata than at {where}; "
                                  "a reward receives metadata by prompt, so a prompt needs the same object each time")
    return {prompt: value for prompt, (value, _) in first.items()}


def reward_by_tag(cfg: Config, prompts: Sequence[str], rewards: Sequence[float]) -> dict[str, float]:
    """The mean reward of the prompts of each metadata ``tag`` (GenEval's six tasks: its score is the mean
    of theirs, not of its prompts); empty when no prompt has a tag."""
    metadata = prompt_metadata(cfg)
    by_tag: dict[str, list[float]] = defaultdict(list)
    for prompt, reward in zip(prompts, rewards, strict=True):
        tag = metadata.get(prompt, {}).get("tag")
        if isinstance(tag, str):
            by_tag[tag].append(reward)
    return {tag: fmean(values) for tag, values in sorted(by_tag.items())}


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


def evaluation_prompts(cfg: Config, seeds_per_prompt: int | None = None) -> tuple[list[str], list[int]]:
    """Fixed across iterations: the same prompts and seeds score every theta_t (prompt-major order).
    ``seeds_per_prompt`` above the config's extends each prompt's seeds, its first ones those a run evaluates on."""
    prompts, seeds = [], []
    for i, prompt in enumerate(heldout_prompts(cfg)):
        for j in range(seeds_per_prompt or cfg.evaluation.seeds_per_prompt):
            prompts.append(prompt)
            seeds.append(derive_seed(cfg.run.seed, "eval", i, j))
    return prompts, seeds


def check_prompts(cfg: Config) -> None:
    """Fail early (PromptError naming the file) if the train or held-out prompts, or their metadata,
    cannot be read."""
    train_prompts(cfg)
    heldout_prompts(cfg)
    prompt_metadata(cfg)
