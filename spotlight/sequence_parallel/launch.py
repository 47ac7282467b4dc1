"""One machine's members of an SP explorer group: import the model stack once, then fork one member per GPU.

An explorer with ``placement.sequence_parallel.degree`` > 1 is this launcher: sky/explorer.yaml runs
``python -m spotlight.sequence_parallel.launch --run URL --group $SKYPILOT_TASK_ID --processes
$SKYPILOT_NUM_GPUS_PER_NODE --device cuda`` (member i gets ``cuda:i``), and the local pool
(tasks/workers.py) runs it with ``--processes <degree>`` and the run's ``run.device``. Each member is its
own process with its own policy, process-group sockets and fate (kill -9 one, the others regroup);
forking only saves each of them importing torch, diffusers and transformers again (seconds of CPU
apiece). The launcher is single-threaded and has not touched CUDA when it forks, so the children
start clean.

Members are named ``{group}-{life}-{i}``, ``life`` a fresh token per launch: a member that left
(SIGTERM) is never taken back under its name, while the group itself (its generations and its lease
holder ``sp-{group}``) carries over a SkyPilot recovery, which relaunches the job under the same task id.
The launcher writes the worker's ready record once its members are forked, passes SIGTERM on to them
(they get it too if the launcher dies), reaps them and prints their exit codes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import secrets
import signal
import socket
import sys
import time
import traceback
from typing import Callable

from spotlight.config import Config
from spotlight.models.policy import check_pretrained, policy_class
from spotlight.queue_worker import exit_code


def preload(cfg: Config) -> None:
    """Import what loading the configured policy imports, before forking."""
    policy_class(cfg.model.kind)
    for name, spec in (check_pretrained(cfg.model) or {}).items():
        if not name.startswith("_") and isinstance(spec, list) and spec[0] is not None:
            getattr(importlib.import_module(spec[0]), spec[1])


def fork_members(names: list[str], child: Callable[[str, int], None]) -> dict[str, int]:
    """Fork one process per name running ``child(name, index)``; their pids by name."""
    from spotlight.queue_worker import term_with_parent

    pids = {}
    for index, name in enumerate(names):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                term_with_parent()
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


def forward_sigterm(pids: dict[str, int], stopped: list[bool]) -> None:
    """SIGTERM to the launcher (a preemption notice, the pool closing) goes to every member; ``stopped``
    then holds True (the launcher exits PREEMPTED_EXIT_CODE unless the run's flow is over)."""
    def forward(signum: int, frame: object) -> None:
        stopped[0] = True
        for pid in pids.values():
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGTERM, forward)


def wait_members(pids: dict[str, int]) -> dict[str, int]:
    """Reap every member; exit codes by name (-N: killed by signal N)."""
    return {name: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for name, pid in pids.items()}


def member_names(group: str, processes: int) -> list[str]:
    life = secrets.token_hex(3)
    return [f"{group}-{life}-{i}" for i in range(processes)]


def main(argv: list[str] | None = None) -> None:
    from spotlight.pool import ready_record_key
    from spotlight.run import run_config
    from spotlight.sequence_parallel.member import group_name, member_options, run_from_args
    from spotlight.store import RunStore

    signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(128 + signum))  # booting: nothing held yet
    p = member_options(argparse.ArgumentParser(prog="python -m spotlight.sequence_parallel.launch",
                                               description="Fork the members of an SP explorer group."))
    p.add_argument("--processes", type=int, help="members to fork, one per GPU (default: the run's "
                   "placement.sequence_parallel.degree)")
    p.add_argument("--members", help="comma-separated member names (default: <group>-<life>-<i>)")
    args = p.parse_args(argv)
    args.group = group_name(args.group)
    cfg = run_config(args.run)  # the store only: no device is touched before the fork
    preload(cfg)
    names = args.members.split(",") if args.members else \
        member_names(args.group, args.processes or cfg.placement.sequence_parallel.degree)
    pids = fork_members(names, lambda name, index: run_from_args(args, name, index))
    stopped = [False]
    forward_sigterm(pids, stopped)
    RunStore(args.run).put_json(ready_record_key(args.group), {
        "worker": args.group, "kind": "explorer", "host": socket.gethostname(), "pid": os.getpid(),
        "ready_at": time.time(), "members": names})
    print(json.dumps({"pids": pids}), flush=True)
    codes = wait_members(pids)
    print(json.dumps({"exit": codes}), flush=True)
    sys.exit(exit_code(args.run, stopped[0]) or next((1 for c in codes.values() if c != 0), 0))


if __name__ == "__main__":
    main()
