"""``spotlight export``: a run's policy theta_N in the form diffusers users load, with a model card.

With ``grpo.ema`` on, the export is theta_N's EMA (the average of the weights, which evaluation scored
too), as flow_grpo saves its EMA weights.

LoRA runs give ``pytorch_lora_weights.safetensors`` (``pipe.load_lora_weights(out)``); full
fine-tunes give ``transformer/`` (``<Transformer>.from_pretrained(out / "transformer")``). The
model card (``README.md``) names the base, the run, the iteration, the held-out rewards of every
evaluation and the run's whole config, so the export says how it was made.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from spotlight.config import ConfigError
from spotlight.ema import ema_state, weights_swapped
from spotlight.models.export import export_full, export_lora
from spotlight.run import Run

CARD = "README.md"


def export_policy(run: Run, iteration: int, out: Path) -> list[Path]:
    """Write theta_``iteration`` of ``run`` to ``out``; returns the files written."""
    cfg = run.cfg
    done = sum(1 for t in range(cfg.grpo.iterations) if run.store.is_committed(run.key("update", t)))
    if not 0 <= iteration <= done:
        raise ConfigError(f"iteration {iteration} is not a committed policy of {run.store.url}: "
                          f"theta_0..theta_{done} exist ({done} updates committed)")
    out.mkdir(parents=True, exist_ok=True)
    # grpo.ema: the average (what evaluation scored, what flow_grpo saves). A pruned checkpoint fails
    # here, naming the retention settings.
    average = ema_state(run, iteration)
    state = average if average is not None else run.policy_state(iteration)
    if cfg.model.lora is not None:
        if state is None:
            state = run.policy_at(0).trainable_state()
        kind = cfg.model.kind if cfg.model.kind != "tiny-mmdit" else "sd3"  # the tiny model is an SD3 transformer
        written = [export_lora(kind, state, out, cfg.model.lora) / "pytorch_lora_weights.safetensors"]
    else:
        with weights_swapped(run.policy_at(iteration), average) as policy:
            written = [export_full(policy.core, out)]
    card = out / CARD
    card.write_text(model_card(run, iteration))
    return [*written, card]


def model_card(run: Run, iteration: int) -> str:
    """A Hugging Face model card: what this is, how to load it, how it scored, how it was trained."""
    cfg = run.cfg
    base = getattr(cfg.model, "pretrained", None) or f"the tiny {cfg.model.kind} base pretrained by the run"
    evals = [run.store.load(f"evaluations/{name}").json("metrics.json") for name in run.store.list("evaluations")
             if run.store.is_committed(f"evaluations/{name}")]
    rows = "\n".join(f"| theta_{m['iteration']} | {m['eval_reward']:.4f} | {m['train_reward_on_eval']:.4f} |"
                     for m in sorted(evals, key=lambda m: m["iteration"]))
    if cfg.model.lora is not None:
        load = ("```python\npipe = <Pipeline>.from_pretrained(BASE)\npipe.load_lora_weights(THIS_FOLDER)\n```")
        what = f"a LoRA adapter (rank {cfg.model.lora.rank}, alpha {cfg.model.lora.alpha:g})"
    else:
        load = ("```python\ntransformer = <Transformer>.from_pretrained(THIS_FOLDER / 'transformer')\n"
                "pipe = <Pipeline>.from_pretrained(BASE, transformer=transformer)\n```")
        what = "a fully fine-tuned transformer"
    if cfg.grpo.ema is not None:
        what += (f": the exponential moving average of the trained weights (decay {cfg.grpo.ema.decay:g}, "
                 f"updated every {cfg.grpo.ema.every} optimizer steps), which the held-out rewards below scored")
    front = yaml.safe_dump({"library_name": "diffusers", "base_model": str(base),
                            "tags": ["flow-grpo", "spotlight", cfg.model.kind]}, sort_keys=False)
    return f"""---
{front}---
# {cfg.run.name}: theta_{iteration}

{what.capitalize()} for `{base}`, post-trained with Flow-GRPO by Spotlight (exploration mode
`{cfg.exploration.mode}`), exported from run `{run.store.url}` after {iteration} iteration(s).

{load}

## Held-out reward

Train reward `{cfg.rewards.describe('train')}`, held-out reward `{cfg.rewards.describe('eval')}`, ODE
sampling ({cfg.sampler.eval_steps} steps, guidance {cfg.sampler.guidance:g}) on fixed evaluation prompts and seeds.

| policy | held-out reward | train reward |
|---|---|---|
{rows}

## Run config

```yaml
{yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)}```
"""
