"""Elastic sequence parallelism on CPU processes with a tiny FLUX.1 (or Qwen-Image) pipeline, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/elastic_sp.py --out /tmp/elastic-sp [--kind qwen-image]

1. Rollout time per image at degree 1, 2 and 4: a group of that many processes (forked by
   ``spotlight.sequence_parallel.launch``, gloo, diffusers' Ulysses context parallelism) rolls out
   the same seeds; per-seed seconds as its leader timed them, and the largest difference of a final
   latent / log-prob from the unsharded in-process rollout of the same seed.
2. Regroup vs cold restart, in one run: a 4-process group works on a long queue; a member is killed
   with -9 and the survivors regroup from the weights in their memory (time from the kill to the new
   generation's first seed); then a brand-new process (``python -m spotlight.sequence_parallel.member``:
   interpreter, imports, base weights from the pipeline folder, theta_t's LoRA adapter from the run
   store) joins the group (time from its spawn to the first seed of a generation that includes it).
   Repeated ``--repeats`` times on the same group.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from spotlight.config import SequenceParallelSection, load_config  # noqa: E402
from spotlight.models.policy import build_policy  # noqa: E402
from spotlight.models.tiny_pipelines import build_tiny_pipeline  # noqa: E402
from spotlight.sequence_parallel import context  # noqa: E402
from spotlight.sequence_parallel.member import make_items, rollout  # noqa: E402
from spotlight.sequence_parallel.rendezvous import Rendezvous  # noqa: E402
from spotlight.store import RunStore, bytes_to_tensors, tensors_to_bytes  # noqa: E402
from spotlight.work_queue import WorkQueue  # noqa: E402

PROMPTS = ["a red cat", "a blue house"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


def member_args(store: RunStore, queue: str, group: str, cfg_path: Path, degree: int) -> list[str]:
    return ["--store", store.url, "--queue", queue, "--group", group, "--config", str(cfg_path),
            "--policy-commit", "policy/theta", "--host", "127.0.0.1", "--sp", f"degree={degree}"]


def launch(names: list[str], args: list[str], log: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    proc = subprocess.Popen([sys.executable, "-m", "spotlight.sequence_parallel.launch", "--member", ",".join(names),
                             *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=open(log, "a"), text=True)
    return proc, json.loads(proc.stdout.readline())["pids"]


def wait_for(what: str, condition, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def working_at(store: RunStore, group: str, number: int) -> float | None:
    key = f"{group}/working/{number:06d}"
    return store.get_json(key)["at"] if store.exists(key) else None


def degrees(out: Path, store: RunStore, cfg, cfg_path: Path, seeds: int) -> list[dict]:
    """Rollout seconds per image and the difference from the unsharded rollout, per degree."""
    policy = build_policy(cfg, "cpu").requires_grad_(False).eval()
    policy.load_trainable_state(store.load("policy/theta").tensors("policy.safetensors"))
    rows_seeds = [[100 * i + k for k in range(seeds)] for i in range(len(PROMPTS))]
    reference, seconds = {}, []
    for prompt, row in zip(PROMPTS, rows_seeds):
        for seed in row:
            started = time.perf_counter()
            reference[(prompt, seed)] = rollout(policy, cfg, prompt, seed)
            seconds.append(time.perf_counter() - started)
    rows = [{"degree": "unsharded (in-process)", "median": statistics.median(seconds), "latent": 0.0,
             "log_prob": 0.0, "n": len(seconds)}]
    for degree in (1, 2, 4):
        queue = WorkQueue(store, f"degree-{degree}")
        queue.publish(make_items(PROMPTS, rows_seeds, 4))
        proc, _ = launch([f"d{degree}-{i}" for i in range(degree)],
                         member_args(store, queue.prefix, f"group-degree-{degree}", cfg_path, degree), out / "members.log")
        proc.wait(timeout=600)
        prompt_of = {u: it["prompt"] for it in queue.items() for u in it["units"]}
        latent_diff = logp_diff = 0.0
        per_seed = []
        for unit, r in queue.results().items():
            ref = reference[(prompt_of[unit], r["seed"])]
            latent = bytes_to_tensors(store.read_bytes(r["latent"]))["latent"]
            latent_diff = max(latent_diff, (latent - ref.latents[0, -1]).abs().max().item())
            logp_diff = max(logp_diff, (torch.tensor(r["log_probs"]) - ref.log_probs[0]).abs().max().item())
            per_seed.append(r["seconds"])
            assert r["degree"] == degree, (unit, r["degree"])
        rows.append({"degree": str(degree), "median": statistics.median(per_seed), "latent": latent_diff,
                     "log_prob": logp_diff, "n": len(per_seed)})
    return rows


def elastic(out: Path, store: RunStore, cfg_path: Path, repeats: int) -> list[dict]:
    """Kill -9 a member, time the survivors' regroup; then spawn a cold process, time its joining."""
    group, sp = "group-elastic", SequenceParallelSection(degree=4)
    queue = WorkQueue(store, "elastic")
    queue.publish(make_items(PROMPTS, [[10_000 * i + k for k in range(2000)] for i in range(len(PROMPTS))], 4))
    args = member_args(store, queue.prefix, group, cfg_path, 4)
    rdv = Rendezvous(store, group, "bench", sp, lambda d: True)
    launcher, pids = launch([f"m{i}" for i in range(4)], args, out / "members.log")
    cold: dict[str, subprocess.Popen] = {}
    rows = []
    try:
        wait_for("the first generation at work", lambda: working_at(store, group, 0))
        for r in range(repeats):
            gen = rdv.latest()
            victim = gen.members[-1]
            killed_at = time.time()
            os.kill(pids[victim] if victim in pids else cold[victim].pid, signal.SIGKILL)
            regrouped = wait_for("the regroup", lambda: (g := rdv.latest()).number > gen.number and g)
            back = wait_for("the regrouped group at work", lambda: working_at(store, group, regrouped.number))
            name = f"cold{r}"
            spawned_at = time.time()
            cold[name] = subprocess.Popen([sys.executable, "-m", "spotlight.sequence_parallel.member", *args,
                                           "--member", name], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                          stderr=open(out / "members.log", "a"))
            joined = wait_for("the cold process in a generation",
                              lambda: name in (g := rdv.latest()).members and g)
            cold_back = wait_for("the cold process at work", lambda: working_at(store, group, joined.number))
            asked = store.get_json(f"{group}/ready/{joined.number:06d}/{name}")["at"]
            rows.append({"repeat": r, "victim": victim, "from": gen.degree, "to": regrouped.degree,
                         "detect_propose": regrouped.proposed_at - killed_at, "regroup": back - killed_at,
                         "cold_loaded": asked - spawned_at, "cold": cold_back - spawned_at, "cold_degree": joined.degree})
    finally:
        for pid in pids.values():
            _terminate(pid)
        for proc in cold.values():
            _terminate(proc.pid)
        launcher.wait(timeout=120)
        for proc in cold.values():
            proc.wait(timeout=120)
    return rows


def _terminate(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/elastic-sp"))
    parser.add_argument("--seeds", type=int, default=8, help="seeds per prompt (2 prompts) for the degree timings")
    parser.add_argument("--repeats", type=int, default=2, help="kill / cold-join rounds (0: degrees only)")
    parser.add_argument("--kind", choices=["flux", "qwen-image"], default="flux")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    torch.set_num_threads(1)
    folder = build_tiny_pipeline(args.kind, args.out / args.kind, heads=4)
    cfg_path = args.out / "run.yaml"
    cfg_path.write_text(f"model: {{kind: {args.kind}, pretrained: {folder}, resolution: 32, max_sequence_length: 32, "
                        "lora: {rank: 4, alpha: 8.0}}\nsampler: {train_steps: 6}\n"
                        "exploration: {coarsen: 2}\nplacement: {lease_seconds: 10}\n")
    cfg = load_config(cfg_path)
    store = RunStore(f"file://{args.out}/store")
    policy = build_policy(cfg, "cpu")  # theta_t: a LoRA adapter moved off its zero start, committed to the store
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in policy.trainable_state().items()}
    store.commit("policy/theta", {"policy.safetensors": tensors_to_bytes(state)})

    console = Console(width=150)
    rows = degrees(args.out, store, cfg, cfg_path, args.seeds)
    tokens = " + ".join(f"{n} {k}" for k, n in context.sequence_lengths(policy).items())
    table = Table(title=f"rollout time per image (tiny {args.kind}, {cfg.exploration_steps} SDE steps, {tokens}, "
                        f"{context.heads(policy)} heads; CPU processes, gloo, Ulysses)")
    for col in ("degree", "seconds / image (median)", "max |latent - unsharded|", "max |log-prob - unsharded|",
                "seeds"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["degree"], f"{r['median']:.3f}", f"{r['latent']:.2e}", f"{r['log_prob']:.2e}", str(r["n"]))
    console.print(table)

    if args.repeats == 0:
        return
    rows = elastic(args.out, store, cfg_path, args.repeats)
    table = Table(title="regroup in memory vs cold restart (4-process group, one member killed with -9)")
    for col in ("round", "degree", "kill -> new generation proposed", "kill -> survivors back to work",
                "cold: spawn -> loaded, asking in", "cold: spawn -> back to work (degree)", "cold / regroup"):
        table.add_column(col)
    for r in rows:
        table.add_row(str(r["repeat"]), f"{r['from']} -> {r['to']}", f"{r['detect_propose']:.3f} s",
                      f"{r['regroup']:.3f} s", f"{r['cold_loaded']:.2f} s", f"{r['cold']:.2f} s ({r['cold_degree']})",
                      f"{r['cold'] / r['regroup']:.0f}x")
    console.print(table)
    console.print(f"regroup_grace_seconds {SequenceParallelSection().regroup_grace_seconds} s; members' logs: "
                  f"{args.out / 'members.log'}")


if __name__ == "__main__":
    main()
