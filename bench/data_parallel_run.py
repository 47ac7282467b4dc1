"""Plain Flow-GRPO (exploration mode ``none``) on N cores: a data-parallel run, one process per core.

The compute-matched baseline of `bench/time_to_target.py`: what a user of plain Flow-GRPO does with a
second GPU. Every rank rolls out and scores its share of the prompt groups, the ranks exchange the
rollouts, and the PPO pass runs under DDP, each rank training its share of every minibatch (the
update stage's data-parallel path, `spotlight.stages.update`). The numbers are those of the 1-core
`none` run up to the last bits (same seeds, same minibatches, the gradient of the same mean loss);
only the wall-clock differs. Launch it with torchrun, one process per core:

    python -m torch.distributed.run --standalone --nproc_per_node 2 bench/data_parallel_run.py \
        --cpus 0,1 --set run.url=file:///tmp/dp --set grpo.iterations=20

It runs the stage functions without Prefect (the flow runs one process): per iteration rank 0
explores (``none``: draws the seeds) and filters, both ranks update, and rank 0 records the
iteration's critical-path seconds in ``timeline/`` (with ``trainer_processes``: core-seconds count
every rank) and evaluates theta_{t+1} while the other ranks wait, outside the timed part, as the flow
does. Each rank records its update seconds in the cost ledger.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

REPO = Path(__file__).resolve().parents[1]


def main(config: Path = typer.Option(REPO / "configs/tiny.yaml"), sets: list[str] = typer.Option([], "--set"),
         cpus: str = typer.Option("", help="pin rank i (LOCAL_RANK) to the i-th of these CPUs")) -> None:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cpus:
        os.sched_setaffinity(0, {int(cpus.split(",")[local_rank])})
    from accelerate import PartialState

    from spotlight import cost, stages
    from spotlight.config import load_config
    from spotlight.report import write_report
    from spotlight.run import open_run

    state = PartialState(cpu=True)  # the process group (gloo) the update's Accelerator joins
    cfg = load_config(config, [*sets, "exploration.mode=none"])
    main_rank = state.is_main_process
    if main_rank:  # commits the config and pretrains; the others open the run once it is there
        run = open_run(cfg)
        stages.pretrain(run)
        stages.evaluate(run, 0)
    state.wait_for_everyone()
    if not main_rank:
        run = open_run(cfg)
    evaluations = set(run.eval_iterations())
    for t in range(cfg.grpo.iterations):
        state.wait_for_everyone()
        started = time.perf_counter()
        if main_rank:
            stages.filter_seeds(run, t)  # explores first: mode none draws the G seeds per prompt
        state.wait_for_everyone()
        update_started = time.perf_counter()
        stages.update(run, t)  # returns on every rank once rank 0 has committed theta_{t+1}
        now = time.perf_counter()
        cost.record(run.store, "update", t, now - update_started, 0.0, f"local-rank{state.process_index}")
        if main_rank:
            stages.record_timing(run, t, {"critical_path_seconds": now - started, "update_seconds": now - update_started,
                                          "explore_wait_seconds": 0.0, "trainer_processes": state.num_processes})
            if t + 1 in evaluations:
                stages.evaluate(run, t + 1)
    state.wait_for_everyone()
    if main_rank:
        write_report(run)
        print(f"data-parallel run ({state.num_processes} processes) done: {run.store.url}", flush=True)


if __name__ == "__main__":
    typer.run(main)
