"""One machine's members: import the model stack once, then fork one member process per GPU.

A worker job with N GPUs runs ``python -m spotlight.sequence_parallel.launch --member g0,g1,g2,g3
--device cuda ...`` (the member options; member i gets ``cuda:i``). Each member is its own process
with its own policy, process-group sockets and fate (kill -9 one, the others regroup); forking only
saves each of them importing torch, diffusers and transformers again (seconds of CPU apiece). The
launcher is single-threaded and has not touched CUDA when it forks, so the children start clean. It
reaps its children and prints their exit codes.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from typing import Callable

import torch

from spotlight.config import Config
from spotlight.models.policy import check_pretrained, policy_class


def preload(cfg: Config) -> None:
    """Import what loading the configured policy imports, before forking."""
    policy_class(cfg.model.kind)
    for name, spec in (check_pretrained(cfg.model) or {}).items():
        if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None:
            getattr(importlib.import_module(spec[0]), spec[1])


def fork_members(names: list[str], child: Callable[[str, int], None]) -> dict[str, int]:
    """Fork one process per name running ``child(name, index)``; their pids by name."""
    pids = {}
    for index, name in enumerate(names):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child(name, index)
            except BaseException:  # noqa: BLE001 - the child must never return into the launcher
                traceback.print_exc()
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[name] = pid
    return pids


def wait_members(pids: dict[str, int]) -> dict[str, int]:
    """Reap every member; exit codes by name (-N: killed by signal N)."""
    return {name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in pids.items()}


def main(argv: list[str] | None = None) -> None:
    from spotlight.config import load_config
    from spotlight.sequence_parallel.member import parser, run_from_args

    p = parser()
    p.prog = "python -m spotlight.sequence_parallel.launch"
    p.description = "Fork one member per GPU (--member takes a comma-separated list of names)."
    args = p.parse_args(argv)
    preload(load_config(args.config, args.set))
    names = args.member.split(",")

    def child(name: str, index: int) -> None:
        run_from_args(args, name, torch.device(f"cuda:{index}" if args.device == "cuda" else args.device))

    pids = fork_members(names, child)
    print(json.dumps({"pids": pids}), flush=True)
    codes = wait_members(pids)
    print(json.dumps({"exit": codes}), flush=True)
    sys.exit(next((1 for c in codes.values() if c != 0), 0))


if __name__ == "__main__":
    main()
