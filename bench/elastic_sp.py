"""Elastic sequence parallelism on CPU processes with a tiny FLUX.1 (or Qwen-Image) pipeline, side by side.

    OMP_NUM_THREADS=1 .venv/bin/python bench/elastic_sp.py --out /tmp/elastic-sp [--kind qwen-image]

Each part is a run (tiny pipeline, LoRA, PickScore on a tiny CLIP; theta_1 a LoRA adapter moved off its
zero start, committed where update(0) commits it) whose exploration queue explore(2) (explored with
theta_1) is worked on by SP explorer groups (``spotlight.sequence_parallel.launch``, gloo, diffusers'
Ulysses context parallelism):

1. Rollout time per image at degree 1, 2 and 4: a group of that many processes explores the same seeds;
   per-seed seconds as its leader timed them, the largest difference of a final latent / log-prob from
   the unsharded in-process rollout of the same seed, and of a unit's rewards from the plain worker's
   (:func:`spotlight.exploration.rollout_rewards` on the unit's batch).
2. Regroup vs cold restart, in one run: a 4-process group works on a long queue; a member is killed
   with -9 and the survivors regroup from the weights in their memory (time from the kill to the new
   generation's first seed); then a brand-new process (``python -m spotlight.sequence_parallel.member``:
   interpreter, imports, base weights from the pipeline folder, theta_1's LoRA adapter from the run
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

from spotlight import exploration  # noqa: E402
from spotlight.config import Config, SequenceParallelSection, config_from_dict  # noqa: E402
from spotlight.models.policy import build_policy  # noqa: E402
from spotlight.models.tiny_clip import build_tiny_clip  # noqa: E402
from spotlight.models.tiny_pipelines import build_tiny_pipeline  # noqa: E402
from spotlight.queue_worker import term_with_parent  # noqa: E402
from spotlight.run import Run, open_run  # noqa: E402
from spotlight.sequence_parallel import context  # noqa: E402
from spotlight.sequence_parallel.member import group_prefix, seed_records  # noqa: E402
from spotlight.sequence_parallel.rendezvous import Rendezvous  # noqa: E402
from spotlight.store import bytes_to_tensors, tensors_to_bytes  # noqa: E402

PROMPTS = ["a red cat", "a blue house"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")


T = 2  # the exploration the groups work on: explore(2) explores with theta_1 (spotlight mode)


def bench_config(out: Path, name: str, parts: dict) -> Config:
    return config_from_dict({
        "run": {"url": f"file://{out}/{name}", "cache_url": f"file://{out}/cache", "device": "cpu"},
        "model": {"kind": parts["kind"], "pretrained": str(parts["pipeline"]), "resolution": 32,
                  "max_sequence_length": 32, "lora": {"rank": 4, "alpha": 8.0}},
        "data": {"prompts": str(parts["prompts"])}, "sampler": {"train_steps": 6},
        "rewards": {"train": "pickscore", "eval": "pickscore", "pickscore": {"model": str(parts["clip"])}},
        "exploration": {"coarsen": 2, "seeds_per_batch": 4}, "placement": {"lease_seconds": 10}})


def make_run(out: Path, name: str, parts: dict, theta: dict) -> Run:
    """A run of the tiny pipeline with theta_1 committed where update(0) commits it."""
    run = open_run(bench_config(out, name, parts))
    run.store.commit(run.key("update", 0), {"policy.safetensors": tensors_to_bytes(theta)})
    return run


def launch(run: Run, group: str, names: list[str], degree: int, log: Path) -> tuple[subprocess.Popen, dict[str, int]]:
    proc = subprocess.Popen([sys.executable, "-m", "spotlight.sequence_parallel.launch", "--members", ",".join(names),
                             *member_args(run, group, degree)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=open(log, "a"), text=True, preexec_fn=term_with_parent)
    return proc, json.loads(proc.stdout.readline())["pids"]


def member_args(run: Run, group: str, degree: int) -> list[str]:
    return ["--run", run.store.url, "--group", group, "--host", "127.0.0.1", "--device", "cpu",
            "--idle-exit", "1", "--sp", f"degree={degree}"]


def wait_for(what: str, condition, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.01)


def working_at(run: Run, group: str, number: int) -> float | None:
    key = f"{group_prefix(group)}/working/{number:06d}"
    return run.store.get_json(key)["at"] if run.store.exists(key) else None


def degrees(out: Path, parts: dict, theta: dict, seeds: int) -> list[dict]:
    """Rollout seconds per image and the differences from the unsharded rollout and the plain worker, per degree."""
    rows_seeds = [[100 * i + k for k in range(seeds)] for i in range(len(PROMPTS))]
    reference = make_run(out, "reference", parts, theta)
    policy = reference.policy_at(1)
    seconds, latents, plain = [], {}, {}
    for prompt, row in zip(PROMPTS, rows_seeds):
        for seed in row:
            started = time.perf_counter()
            latents[(prompt, seed)] = exploration.exploration_rollout(reference.cfg, policy, [prompt], [seed])
            seconds.append(time.perf_counter() - started)
    for item in exploration.make_items(PROMPTS, rows_seeds, 4):
        for unit in item["units"]:
            plain[unit] = exploration.rollout_rewards(reference, policy, item["prompt"], item["batches"][unit])
    rows = [{"degree": "unsharded (in-process)", "median": statistics.median(seconds), "latent": 0.0,
             "log_prob": 0.0, "reward": 0.0, "n": len(seconds)}]
    for degree in (1, 2, 4):
        run = make_run(out, f"degree-{degree}", parts, theta)
        queue = exploration.queue_for(run, T)
        queue.publish(exploration.make_items(PROMPTS, rows_seeds, 4))
        proc, _ = launch(run, "group", [f"d{degree}-{i}" for i in range(degree)], degree, out / "members.log")
        proc.wait(timeout=600)
        latent_diff = logp_diff = reward_diff = 0.0
        per_seed, results = [], queue.results()
        for item in queue.items():
            for unit in item["units"]:
                result = results[unit]
                reward_diff = max(reward_diff, *(abs(a - b) for a, b in zip(result["rewards"], plain[unit])))
                for r in seed_records(run.store, queue, unit).values():
                    ref = latents[(item["prompt"], r["seed"])]
                    latent = bytes_to_tensors(run.store.read_bytes(r["latent"]))["latent"]
                    latent_diff = max(latent_diff, (latent - ref.latents[0, -1]).abs().max().item())
                    logp_diff = max(logp_diff, (torch.tensor(r["log_probs"]) - ref.log_probs[0]).abs().max().item())
                    per_seed.append(r["seconds"])
                    assert r["degree"] == degree, (unit, r["degree"])
        rows.append({"degree": str(degree), "median": statistics.median(per_seed), "latent": latent_diff,
                     "log_prob": logp_diff, "reward": reward_diff, "n": len(per_seed)})
    return rows


def elastic(out: Path, parts: dict, theta: dict, repeats: int) -> list[dict]:
    """Kill -9 a member, time the survivors' regroup; then spawn a cold process, time its joining."""
    group, sp = "elastic", SequenceParallelSection(degree=4)
    run = make_run(out, "elastic", parts, theta)
    queue = exploration.queue_for(run, T)
    queue.publish(exploration.make_items(PROMPTS, [[10_000 * i + k for k in range(2000)]
                                                   for i in range(len(PROMPTS))], 4))
    args = member_args(run, group, 4)
    rdv = Rendezvous(run.store, group_prefix(group), "bench", sp, lambda d: True)
    launcher, pids = launch(run, group, [f"m{i}" for i in range(4)], 4, out / "members.log")
    cold: dict[str, subprocess.Popen] = {}
    rows = []
    try:
        wait_for("the first generation at work", lambda: working_at(run, group, 0))
        for r in range(repeats):
            gen = rdv.latest()
            victim = gen.members[-1]
            killed_at = time.time()
            os.kill(pids[victim] if victim in pids else cold[victim].pid, signal.SIGKILL)
            regrouped = wait_for("the regroup", lambda: (g := rdv.latest()).number > gen.number and g)
            back = wait_for("the regrouped group at work", lambda: working_at(run, group, regrouped.number))
            name = f"cold{r}"
            spawned_at = time.time()
            cold[name] = subprocess.Popen([sys.executable, "-m", "spotlight.sequence_parallel.member", *args,
                                           "--member", name], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL,
                                          stderr=open(out / "members.log", "a"), preexec_fn=term_with_parent)
            joined = wait_for("the cold process in a generation",
                              lambda: name in (g := rdv.latest()).members and g)
            cold_back = wait_for("the cold process at work", lambda: working_at(run, group, joined.number))
            asked = run.store.get_json(f"{group_prefix(group)}/ready/{joined.number:06d}/{name}")["at"]
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
    prompts = args.out / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    parts = {"kind": args.kind, "pipeline": build_tiny_pipeline(args.kind, args.out / args.kind, heads=4),
             "clip": build_tiny_clip(args.out / "clip"), "prompts": prompts}
    cfg = bench_config(args.out, "reference", parts)
    policy = build_policy(cfg, "cpu")
    g = torch.Generator().manual_seed(0)  # theta_1: a LoRA adapter moved off its zero start
    theta = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in policy.trainable_state().items()}

    console = Console(width=150)
    rows = degrees(args.out, parts, theta, args.seeds)
    tokens = " + ".join(f"{n} {k}" for k, n in context.sequence_lengths(policy).items())
    table = Table(title=f"rollout time per image (tiny {args.kind}, {cfg.exploration_steps} SDE steps, {tokens}, "
                        f"{context.heads(policy)} heads; CPU processes, gloo, Ulysses)")
    for col in ("degree", "seconds / image (median)", "max |latent - unsharded|", "max |log-prob - unsharded|",
                "max |unit reward - plain worker|", "seeds"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["degree"], f"{r['median']:.3f}", f"{r['latent']:.2e}", f"{r['log_prob']:.2e}",
                      f"{r['reward']:.2e}", str(r["n"]))
    console.print(table)

    if args.repeats == 0:
        return
    rows = elastic(args.out, parts, theta, args.repeats)
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
