"""theta_N re-evaluated on many more seeds per held-out prompt than a run evaluates on, and the sampling
noise of the run's own evaluation.

A run evaluates every policy on the config's 16 seeds per held-out prompt (160 digit images): enough to
draw a curve, but the number it gives for one policy depends on which 160 noise draws it took. Re-evaluating
theta_0 and theta_N on K seeds per prompt measures what the quality goal is about, the policy's expected
held-out reward, diversity and realism, with that noise K/16 times smaller in variance. The run's own seeds
come first, and every variant run on a seed has the same evaluation seeds, so method and baseline stay
paired; the K seeds cut into chunks of the run's size measure the noise of one evaluation itself.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from statistics import fmean

QUANTITIES = ("eval_reward", "diversity_vs_base", "realism_digits")


def reevaluate(run_dir: str, iteration: int, seeds_per_prompt: int) -> list[dict[str, float]]:
    """theta_``iteration``'s held-out reward, diversity relative to theta_0's and realism on ``seeds_per_prompt``
    seeds per held-out prompt (first row), then the same on each chunk of the run's own evaluation size
    (the first chunk: the seeds the run evaluated on)."""
    from spotlight.prompts import evaluation_prompts
    from spotlight.quality import diversity_per_prompt, realism_digits
    from spotlight.run import open_run_from_url
    from spotlight.stages import evaluation_samples

    run = open_run_from_url(f"file://{run_dir}")
    chunk = run.cfg.evaluation.seeds_per_prompt
    if seeds_per_prompt % chunk or seeds_per_prompt < 2 * chunk:
        raise ValueError(f"--seeds-per-prompt must be a multiple (>= 2) of the runs' {chunk}, got {seeds_per_prompt}")
    prompts, seeds = evaluation_prompts(run.cfg, seeds_per_prompt)
    n = len(prompts) // seeds_per_prompt
    parts = [slice(0, seeds_per_prompt)] + [slice(c, c + chunk) for c in range(0, seeds_per_prompt, chunk)]
    scored = {}
    for t in (0, iteration):
        images = evaluation_samples(run, t, prompts, seeds)
        held_out = run.weighted_reward("eval")(images, prompts).view(n, seeds_per_prompt)
        images = images.view(n, seeds_per_prompt, *images.shape[1:])
        scored[t] = [{"eval_reward": held_out[:, part].mean().item(),
                      "diversity": fmean(diversity_per_prompt(images[:, part].flatten(0, 1), n)),
                      "realism_digits": realism_digits(images[:, part].flatten(0, 1))} for part in parts]
    return [{"eval_reward": last["eval_reward"], "diversity_vs_base": last["diversity"] / base["diversity"],
             "realism_digits": last["realism_digits"]} for last, base in zip(scored[iteration], scored[0])]


def reevaluated(run_dirs: list[Path], iteration: int, seeds_per_prompt: int, parallel: int = 2
                ) -> dict[Path, list[dict[str, float]]]:
    """:func:`reevaluate` for each run, cached per folder of runs (``reevaluated-{K}-{N}.json`` beside them),
    the missing ones computed ``parallel`` at a time, one core each."""
    caches = {d.parent / f"reevaluated-{seeds_per_prompt}-{iteration}.json" for d in run_dirs}
    known = {c.parent / name: rows for c in caches if c.exists() for name, rows in json.loads(c.read_text()).items()}
    missing = [d for d in run_dirs if d not in known]
    if missing:
        os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes
        with ProcessPoolExecutor(parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
            for d, rows in zip(missing, pool.map(reevaluate, map(str, missing), [iteration] * len(missing),
                                                 [seeds_per_prompt] * len(missing))):
                known[d] = rows
        for cache in caches:
            cache.write_text(json.dumps({d.name: rows for d, rows in known.items() if d.parent == cache.parent},
                                        indent=1))
    return {d: known[d] for d in run_dirs}
