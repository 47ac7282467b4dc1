"""What the base policy itself offers at a high held-out reward: its samples filtered by the held-out
reward, with their within-prompt diversity and realism (issue 17's quality goal asks a trained policy for
held-out >= 0.98 at >= 0.85x the base's diversity; a base filtered to that reward shows whether the reward
forces the diversity down or the training path does).

    OMP_NUM_THREADS=1 .venv/bin/python bench/filtered_base.py --seeds-per-prompt 128
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from iterations_to_target import open_run


def main(seeds_per_prompt: int = 128, seed: int = 0, out: Path = typer.Option(None),
         thresholds: str = "0.5,0.8,0.9,0.95,0.97,0.99") -> None:
    from spotlight import stages
    from spotlight.prompts import evaluation_prompts
    from spotlight.quality import diversity_per_prompt, realism_digits
    from spotlight.sampler import sample_ode_batched

    root = out or Path(tempfile.mkdtemp(prefix="filtered-base-"))
    run = open_run(f"file://{root}/base-s{seed}", f"file://{root}/cache", seed, 1, [])
    stages.pretrain(run)
    sc = run.cfg.sampler
    prompts = list(dict.fromkeys(evaluation_prompts(run.cfg)[0]))
    n = seeds_per_prompt
    # seeds apart from the evaluation's (0..15 per prompt): the same ODE sampler, more of them
    images = sample_ode_batched(run.policy_at(0), [p for p in prompts for _ in range(n)],
                                [10_000 + i for _ in prompts for i in range(n)], 256, steps=sc.eval_steps,
                                guidance=sc.guidance, negative_prompt=sc.negative_prompt)
    held = run.weighted_reward("eval")(images, [p for p in prompts for _ in range(n)]).view(len(prompts), n)
    per_prompt = images.view(len(prompts), n, *images.shape[1:])
    base = sum(diversity_per_prompt(images, len(prompts))) / len(prompts)
    table = Table(title=f"the base policy's ODE samples ({n} seeds x {len(prompts)} prompts), kept where the "
                        f"held-out reward >= a threshold")
    for col in ("kept where held-out >=", "mean held-out", "diversity / the unfiltered base's", "realism (lower: better)",
                "samples kept"):
        table.add_column(col)
    table.add_row("(all)", f"{held.mean():.3f}", "1.000", f"{realism_digits(images):.3f}", f"{held.numel()}")
    for tau in (float(t) for t in thresholds.split(",")):
        keep = [held[p] >= tau for p in range(len(prompts))]
        groups = [p for p in range(len(prompts)) if keep[p].sum() >= 2]
        diversity = sum(diversity_per_prompt(per_prompt[p][keep[p]], 1)[0] for p in groups) / len(groups)
        kept = torch.cat([per_prompt[p][keep[p]] for p in groups])
        reward = sum(held[p][keep[p]].mean().item() for p in groups) / len(groups)
        table.add_row(f"{tau:g}", f"{reward:.3f}", f"{diversity / base:.3f}", f"{realism_digits(kept):.3f}",
                      f"{len(kept)}")
    Console(width=160).print(table)


if __name__ == "__main__":
    typer.run(main)
