"""A trainer process on a tiny pipeline, measuring what it holds (run by tests/test_memory.py in a fresh process).

``python -m tests.trainer_residency OUT.json SET...``: opens the run the ``--set`` overrides of
configs/sd35m-pickscore.yaml describe and runs, in this one process, what a trainer worker runs: an
exploration (the same ``explore_units`` a trainer that joins one runs), update(0), evaluate(1), the
exploration of iteration 1 (theta_0, stale) and the ranking check of iteration 1 (theta_1, fresh). After each
stage, and at every optimizer step of the update, it records :func:`spotlight.memory.resident_bytes`: every
module and optimizer alive in the process, found through the garbage collector, with the bytes of the reward's
preprocessing buffers and the number of trainable tensors. Writes the records as JSON.
"""

from __future__ import annotations

import gc
import json
import sys
from dataclasses import asdict

from torch.optim.optimizer import register_optimizer_step_post_hook

from spotlight import stages
from spotlight.clip_rewards import ClipImagePreprocess
from spotlight.config import load_config
from spotlight.memory import resident_bytes, tensor_bytes
from spotlight.run import open_run
from tests.conftest import REPO


def main(out: str, sets: list[str]) -> None:
    run = open_run(load_config(REPO / "configs" / "sd35m-pickscore.yaml", sets))
    records: list[dict] = []

    def record(when: str) -> None:
        preprocess = [m for m in gc.get_objects() if isinstance(m, ClipImagePreprocess)]
        records.append({"when": when, **asdict(resident_bytes()),
                        "preprocess_buffers": tensor_bytes(b for m in preprocess for b in m.buffers()),
                        "trainable_tensors": len(run.resident_policy().trainable_parameters())})

    register_optimizer_step_post_hook(lambda *_: record("update(0) optimizer step"))
    stages.explore(run, 0)
    record("explore(0), in this process")
    stages.update(run, 0)
    record("update(0)")
    stages.evaluate(run, 1)
    record("evaluate(1)")
    stages.explore(run, 1)
    record("explore(1) with theta_0")
    stages.ranking_check(run, 1)
    record("ranking(1) with theta_1")
    with open(out, "w") as f:
        json.dump(records, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
