"""Fork an SP group's members for tests, with the faults a test needs landing where it needs them.

    python tests/sp_launch.py SPEC.json

SPEC: ``{"args": [member options: --run, --group, ...], "members": {name: options}}``; a member's
options: ``die_at_call`` (SIGKILL itself at its N-th transformer call: mid-seed, deterministically),
``arrive`` (a file to wait for before starting: a replacement arriving later), ``weights``
(``peer``: receive every weight from the group), ``pretrained`` (its pipeline folder).
Prints ``{"pids": ...}`` once forked, then ``{"exit": ...}`` (-9: killed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from spotlight.run import run_config
from spotlight.sequence_parallel.launch import fork_members, preload, wait_members
from spotlight.sequence_parallel.member import parser, run_from_args


def die_at(calls: int):
    def hook(policy) -> None:
        velocity, count = policy.velocity, [0]

        def counted(*args, **kwargs):
            count[0] += 1
            if count[0] == calls:
                os.kill(os.getpid(), signal.SIGKILL)
            return velocity(*args, **kwargs)

        policy.velocity = counted
    return hook


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    args = parser().parse_args([*spec["args"], "--member", "-"])
    preload(run_config(args.run))

    def child(name: str, index: int) -> None:
        options = spec["members"][name]
        while "arrive" in options and not Path(options["arrive"]).exists():
            time.sleep(0.05)
        argv = [*spec["args"], "--member", name, "--weights", options.get("weights", "pretrained"),
                *(["--pretrained", options["pretrained"]] if "pretrained" in options else [])]
        hook = die_at(options["die_at_call"]) if "die_at_call" in options else None
        run_from_args(parser().parse_args(argv), name, index, hook)

    pids = fork_members(list(spec["members"]), child)
    print(json.dumps({"pids": pids}), flush=True)
    print(json.dumps({"exit": wait_members(pids)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
