"""What the base policy itself offers at a high held-out reward: its samples filtered by the held-out
reward, with their within-prompt diversity and realism (issue 17's quality goal asks a trained policy for
held-out >= 0.98 at >= 0.85x the base's diversity; a base filtered to that reward shows whether the reward
forces the diversity down or the training path does). Beside them, the real digits the held-out
classifier never saw, as the same three numbers; ``--classifier-seeds`` adds what they score under each
run seed's held-out classifier, digit by digit (training only the classifiers).

    OMP_NUM_THREADS=1 .venv/bin/python bench/filtered_base.py --seeds-per-prompt 128
    OMP_NUM_THREADS=1 .venv/bin/python bench/filtered_base.py --seeds-per-prompt 0 --classifier-seeds 0,1,2,3,4,5,6,7,8,9
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import typer
from rich.console import Console
from rich.table import Table

from iterations_to_target import open_run

from spotlight.data import DIGIT_PROMPTS, NUM_CLASSES, other_half, split
from spotlight.run import Run


def unseen_real_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """The half of the digits the held-out classifier was not trained on, and their labels."""
    from spotlight.stages import CLASSIFIERS

    return split(other_half(CLASSIFIERS["eval_classifier"][0]))


def held_out_per_digit(run: Run) -> list[float]:
    """The held-out reward of the unseen real digits of each class, under this run seed's classifier."""
    images, labels = unseen_real_digits()
    scores = run.weighted_reward("eval")(images, [DIGIT_PROMPTS[k] for k in labels.tolist()])
    return [scores[labels == k].mean().item() for k in range(NUM_CLASSES)]


def classifier_table(seeds: list[int], root: Path) -> Table:
    from spotlight import stages

    table = Table(title="real digits the held-out classifier never saw, under each run seed's held-out classifier "
                        "(mean per digit, then over the ten digits)")
    for col in ("run seed", "all digits", "digit 1", "the lowest digit", "the other nine"):
        table.add_column(col)
    for seed in seeds:
        run = open_run(f"file://{root}/classifiers-s{seed}", f"file://{root}/cache", seed, 1, [])
        stages.train_digit_classifiers(run)
        per = held_out_per_digit(run)
        low = min(range(NUM_CLASSES), key=per.__getitem__)
        table.add_row(str(seed), f"{sum(per) / NUM_CLASSES:.3f}", f"{per[1]:.3f}", f"{low}: {per[low]:.3f}",
                      f"{(sum(per) - per[1]) / (NUM_CLASSES - 1):.3f}")
    return table


def main(seeds_per_prompt: int = typer.Option(128, help="base samples per digit prompt (0: skip the filtered base)"),
         seed: int = 0, out: Path = typer.Option(None), thresholds: str = "0.5,0.8,0.9,0.95,0.97,0.99",
         classifier_seeds: str = typer.Option("", help="also score the unseen real digits under these run seeds' "
                                                      "held-out classifiers, comma-separated")) -> None:
    root = out or Path(tempfile.mkdtemp(prefix="filtered-base-"))
    if seeds_per_prompt:
        filtered_base(seeds_per_prompt, seed, root, thresholds)
    if classifier_seeds:
        Console(width=160).print(classifier_table([int(s) for s in classifier_seeds.split(",")], root))


def filtered_base(seeds_per_prompt: int, seed: int, root: Path, thresholds: str) -> None:
    from spotlight import stages
    from spotlight.prompts import evaluation_prompts
    from spotlight.quality import diversity_per_prompt, realism_digits, realism_digits_real
    from spotlight.sampler import sample_ode_batched

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
    real, labels = unseen_real_digits()
    real_diversity = sum(diversity_per_prompt(real[labels == k], 1)[0] for k in range(NUM_CLASSES)) / NUM_CLASSES
    table.add_row("real digits the held-out classifier never saw (per digit, realism leave-one-out)",
                  f"{sum(held_out_per_digit(run)) / NUM_CLASSES:.3f}", f"{real_diversity / base:.3f}",
                  f"{realism_digits_real():.3f}", f"{len(real)}")
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
