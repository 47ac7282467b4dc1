"""The base model and reward classifiers, trained once from the bundled digits and cached.

Rectified-flow pretraining: ``x_sigma = (1 - sigma) x0 + sigma * noise``, regress ``v = noise - x0``
with sigma drawn logit-normally (as SD3 trains), the prompt dropped to the null prompt with some
probability so classifier-free guidance is available, and EMA weights as the released base.
Every batch is drawn from a generator seeded by (seed, step), so a resumed pretraining continues
exactly where an uninterrupted one would be.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn.functional as F

from spotlight.config import Config
from spotlight.data import DIGIT_PROMPTS, NULL_PROMPT, digits, split
from spotlight.models.classifier import DigitClassifier
from spotlight.models.tiny import DEFAULT_SHIFT, TinyMMDiT
from spotlight.seeding import generator

Progress = Callable[[int, int, dict], None]


def rectified_flow_loss(policy: TinyMMDiT, x0: torch.Tensor, prompts: list[str], g: torch.Generator) -> torch.Tensor:
    noise = torch.randn(x0.shape, generator=g)
    sigma = torch.sigmoid(torch.randn(x0.shape[0], generator=g))
    s = sigma.view(-1, 1, 1, 1)
    x = (1 - s) * x0 + s * noise
    v = policy.velocity(x, sigma, policy.encode_prompts(prompts))
    return F.mse_loss(v, noise - x0)


def pretrain_batch(cfg: Config, step: int) -> tuple[torch.Tensor, list[str], torch.Generator]:
    images, labels = digits()
    g = generator(cfg.run.seed, "pretrain", step)
    idx = torch.randint(len(labels), (cfg.pretrain.batch_size,), generator=g)
    drop = torch.rand(cfg.pretrain.batch_size, generator=g) < cfg.pretrain.null_prompt_prob
    prompts = [NULL_PROMPT if d else DIGIT_PROMPTS[int(y)] for y, d in zip(labels[idx], drop)]
    return images[idx], prompts, g


class BaseTrainer:
    """Policy + EMA + optimizer; state round-trips through tensors so chunks commit and resume."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        torch.manual_seed(cfg.run.seed)
        self.policy = TinyMMDiT(cfg.model, cfg.sampler.shift or DEFAULT_SHIFT)
        self.ema = copy.deepcopy(self.policy).requires_grad_(False)
        self.opt = torch.optim.AdamW(self.policy.transformer.parameters(), lr=cfg.pretrain.lr, weight_decay=0.0)
        self.step = 0

    def lr_at(self, step: int) -> float:
        warmup = max(1, self.cfg.pretrain.steps // 20)
        return self.cfg.pretrain.lr * min(1.0, (step + 1) / warmup)

    def train(self, until: int, progress: Progress | None = None) -> None:
        while self.step < until:
            decay = min(self.cfg.pretrain.ema_decay, (1 + self.step) / (10 + self.step))  # EMA warm-up
            x0, prompts, g = pretrain_batch(self.cfg, self.step)
            for group in self.opt.param_groups:
                group["lr"] = self.lr_at(self.step)
            loss = rectified_flow_loss(self.policy, x0, prompts, g)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.transformer.parameters(), 1.0)
            self.opt.step()
            with torch.no_grad():
                for e, p in zip(self.ema.transformer.parameters(), self.policy.transformer.parameters()):
                    e.lerp_(p, 1 - decay)
            self.step += 1
            if progress:
                progress(self.step, self.cfg.pretrain.steps, {"loss": loss.item()})

    def state(self) -> dict[str, torch.Tensor]:
        out = {f"policy.{k}": v for k, v in self.policy.trainable_state().items()}
        out |= {f"ema.{k}": v for k, v in self.ema.trainable_state().items()}
        out |= {f"opt.{k}": v for k, v in optimizer_tensors(self.opt).items()}
        return out

    def load(self, state: dict[str, torch.Tensor], step: int) -> None:
        pick = lambda prefix: {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}  # noqa: E731
        self.policy.load_trainable_state(pick("policy."))
        self.ema.load_trainable_state(pick("ema."))
        load_optimizer_tensors(self.opt, pick("opt."))
        self.step = step


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Adam(W) state as flat tensors (safetensors-friendly): ``<param index>.<name>``."""
    out = {}
    for idx, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{idx}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor]) -> None:
    sd = opt.state_dict()
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value.clone()
    sd["state"] = state
    opt.load_state_dict(sd)


def train_classifier(part: str, width: int, steps: int, seed: int, progress: Progress | None = None) -> DigitClassifier:
    """A CNN on one half of the digits, with small random shifts so it judges generated digits fairly."""
    images, labels = split(part)
    torch.manual_seed(seed)
    model = DigitClassifier(width=width)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(labels), (128,), generator=g)
        x = images[idx]
        shift = torch.randint(-1, 2, (2,), generator=g).tolist()
        x = torch.roll(x, shifts=shift, dims=(2, 3))
        x = x + 0.1 * torch.randn(x.shape, generator=g)
        loss = F.cross_entropy(model.logits(x), labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if progress:
            progress(step + 1, steps, {"loss": loss.item()})
    return model.eval()


@torch.no_grad()
def classifier_accuracy(model: DigitClassifier, part: str) -> float:
    images, labels = split(part)
    return (model(images).argmax(-1) == labels).float().mean().item()
