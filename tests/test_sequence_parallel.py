"""Elastic sequence-parallel explorer groups on CPU processes (gloo, diffusers' Ulysses context
parallelism) with a tiny FLUX.1 pipeline (4 heads, 64 image + 32 text tokens: valid degrees 1, 2, 4)
exploring a run's real exploration queues, scored by a tiny CLIP's PickScore.

1. A run explored by a 2-process group (``placement.sequence_parallel.degree: 2``; LoRA; explore(0)
   with theta_0, update(0), explore(1) with theta_1, sync mode) against the same run explored by the
   plain worker's code: the same seeds, rewards within REWARD_TOL, and bit-identical theta_1 (the
   filter chose the same seeds). One member is killed with -9 mid-unit in explore(1); the survivor
   regroups and finishes, no unit lost or recorded twice.
2. A 4-process group: m2 SIGKILLs itself mid-seed (mid-unit), the 3 survivors regroup at degree 2
   (3 does not divide 4 heads) with one spare; a replacement m4 whose pipeline folder holds no weight
   file arrives, joins at a unit boundary and receives every weight from a peer (degree 4 again); a
   member gets SIGTERM, finishes the seed in hand and leaves; the rest drain the queue.
3. The leader (it holds the lease and hosts the generation's store) is killed mid-unit: the next
   leader frees the group's lease at once and continues the unit from its committed seeds.

Tolerances (fp32, CPU; measured by bench/elastic_sp.py): each seed's final latent within 7.2e-7 of the
unsharded rollout's and its log-probs within 1.2e-7 at degree 2 and 4 (we assert 1e-5; degree 1 in a
group is bit-identical). A unit's rewards are within 1.2e-5 of the plain worker's (we assert 1e-4): a
plain worker rolls out a unit's seeds as one batch, a group one seed at a time (batch-1 rollouts differ
from batch-4 ones by ~5e-7 even unsharded), and PickScore quantises images to 8 bits, so where a pixel
sits on a rounding boundary it flips by 1/255.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from spotlight import exploration, stages
from spotlight.config import ConfigError, SequenceParallelSection, config_from_dict
from spotlight.models.tiny_clip import build_tiny_clip
from spotlight.models.tiny_pipelines import build_tiny_pipeline
from spotlight.planner import PlannerState, plan_exploration
from spotlight.pool import mark_pool_done
from spotlight.prompts import iteration_prompts
from spotlight.run import Run, open_run
from spotlight.sequence_parallel import context
from spotlight.sequence_parallel.member import group_prefix, seed_records
from spotlight.sequence_parallel.rendezvous import Rendezvous
from spotlight.store import bytes_to_tensors
from spotlight.work_queue import WorkQueue
from tasks.workers import worker_pool

REPO = Path(__file__).resolve().parents[1]
TOL = 1e-5
REWARD_TOL = 1e-4
PROMPTS = ["a red cat", "a blue house", "a photo of a dog", "a green tree"]
SEEDS_PER_PROMPT, SEEDS_PER_BATCH = 12, 4
STEPS = 3  # exploration steps per seed (train_steps 6, coarsen 2): 3 transformer calls per seed
GROUP = "g"


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("sp")
    folder = build_tiny_pipeline("flux", root / "flux", heads=4)
    weightless = root / "flux-no-weights"  # what a replacement may read: configs and tokenizers only
    shutil.copytree(folder, weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    return {"root": root, "flux": folder, "weightless": weightless, "clip": build_tiny_clip(root / "clip"),
            "prompts": prompts}


def make_run(parts: dict, path: Path, degree: int, lease_seconds: float = 4.0) -> Run:
    """A tiny FLUX.1 run with a LoRA adapter and PickScore (tiny CLIP), explored in sync mode."""
    return open_run(config_from_dict({
        "run": {"url": f"file://{path}", "cache_url": f"file://{parts['root']}/cache", "device": "cpu"},
        "model": {"kind": "flux", "pretrained": str(parts["flux"]), "resolution": 32, "max_sequence_length": 32,
                  "lora": {"rank": 4, "alpha": 8.0}},
        "data": {"prompts": str(parts["prompts"])},
        "sampler": {"train_steps": 6, "eval_steps": 4},
        "rewards": {"train": "pickscore", "eval": "pickscore", "pickscore": {"model": str(parts["clip"])}},
        "grpo": {"iterations": 2, "prompts_per_iteration": 2, "group_size": 4, "optimizer_steps": 4},
        "exploration": {"mode": "sync", "candidates_per_prompt": 8, "max_candidates_per_prompt": 8,
                        "seeds_per_batch": SEEDS_PER_BATCH, "coarsen": 2, "extra_prompts": 1, "ranking_every": 0},
        "placement": {"lease_seconds": lease_seconds, "stall_seconds": 600,
                      "sequence_parallel": {"degree": degree, "regroup_grace_seconds": 1.0}}}))


def start_group(tmp_path: Path, run: Run, members: dict, degree: int) -> tuple[subprocess.Popen, dict]:
    """The members forked by tests/sp_launch.py (until the pool is marked done)."""
    spec = {"members": members, "args": ["--run", run.store.url, "--group", GROUP, "--host", "127.0.0.1",
                                         "--idle-exit", "600", "--sp", f"degree={degree}"]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    launcher = subprocess.Popen([sys.executable, str(REPO / "tests/sp_launch.py"), str(tmp_path / "spec.json")],
                                env=env, stdout=subprocess.PIPE, stderr=open(tmp_path / "members.log", "w"), text=True)
    return launcher, json.loads(launcher.stdout.readline())["pids"]


def exit_codes(launcher: subprocess.Popen, tmp_path: Path, timeout: float) -> dict[str, int]:
    try:
        out, _ = launcher.communicate(timeout=timeout)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, (tmp_path / "members.log").read_text()[-3000:]
    return json.loads(out.strip().splitlines()[-1])["exit"]


def wait_for(what: str, condition, deadline: float, launcher: subprocess.Popen) -> None:
    while not condition():
        if time.monotonic() > deadline or launcher.poll() is not None:
            raise AssertionError(f"timed out waiting for {what}; launcher: {launcher.poll()}")
        time.sleep(0.05)


def publish(run: Run, t: int, prompts: list[str], seeds: list[list[int]]) -> WorkQueue:
    queue = exploration.queue_for(run, t)
    queue.publish(exploration.make_items(prompts, seeds, SEEDS_PER_BATCH))
    return queue


def group_stats(run: Run, members: list[str]) -> dict[str, dict]:
    return {m: run.store.get_json(f"{group_prefix(GROUP)}/stats/{m}") for m in members}


def check_queue(run: Run, queue: WorkQueue, survivors: list[str]) -> dict[str, dict[int, dict]]:
    """No unit lost or recorded twice, no finished seed rolled out again, and every number within its
    tolerance: each seed's final latent and log-probs of its unsharded rollout, each unit's rewards of the
    plain worker's. Returns the seed records by unit."""
    assert queue.drained()
    items = queue.items()
    units = [u for item in items for u in item["units"]]
    assert len(units) == len(set(units))
    for item in items:  # one record per unit, all by the group, and the item completed once
        assert run.store.list(f"{queue.prefix}/units/{item['id']}") == sorted(item["units"])
        assert queue.done_by(item["id"]) == f"sp-{GROUP}"
    results = queue.results()
    assert set(results) == set(units)
    seeds = {u: seed_records(run.store, queue, u) for u in units}
    stats = group_stats(run, survivors)
    assert sum(s["recomputed"] for s in stats.values()) == 0  # no finished seed was ever rolled out again
    for m, s in stats.items():  # each leader's commits are the seeds its generations committed
        assert s["committed"] == sum(r["members"][0] == m for recs in seeds.values() for r in recs.values())
    policy = run.policy_at(exploration.policy_iteration(run.cfg, 0))
    for item in items:
        for unit in item["units"]:
            batch = item["batches"][unit]
            assert [seeds[unit][k]["seed"] for k in range(len(batch))] == batch == results[unit]["seeds"]
            plain = exploration.rollout_rewards(run, policy, item["prompt"], batch)
            assert max(abs(a - b) for a, b in zip(results[unit]["rewards"], plain)) < REWARD_TOL, unit
            for k, seed in enumerate(batch):
                r = seeds[unit][k]
                ref = exploration.exploration_rollout(run.cfg, policy, [item["prompt"]], [seed])
                latent = bytes_to_tensors(run.store.read_bytes(r["latent"]))["latent"]
                assert (latent - ref.latents[0, -1]).abs().max() < TOL, (unit, k, r["degree"])
                assert (torch.tensor(r["log_probs"]) - ref.log_probs[0]).abs().max() < TOL, (unit, k, r["degree"])
    # the kill landed mid-unit: its first seeds were committed in generation 0, the rest after the regroup
    assert any({r["generation"] for r in recs.values()} >= {0, 1} for recs in seeds.values()), \
        "no unit was interrupted by the kill"
    return seeds


def test_valid_degrees_and_ring_on_cpu():
    lengths = {"image tokens": 64, "text tokens": 32}
    assert [d for d in range(1, 9) if context.valid_degree(d, "ulysses", 4, lengths)] == [1, 2, 4]
    assert [d for d in range(1, 9) if context.valid_degree(d, "ring", 4, lengths)] == [1, 2, 4, 8]
    assert context.largest_valid_degree(3, "ulysses", 4, lengths) == 2
    assert context.largest_valid_degree(3, "ulysses", 3, {"image tokens": 63, "text tokens": 30}) == 3
    with pytest.raises(ConfigError, match="return_lse"):
        context.check_mode(SequenceParallelSection(degree=2, mode="ring"), torch.device("cpu"))
    with pytest.raises(ValueError, match="two heartbeats"):
        SequenceParallelSection(heartbeat_seconds=1.0, dead_after_seconds=1.5)
    with pytest.raises(ValueError, match="no context-parallel plan"):
        config_from_dict({"placement": {"sequence_parallel": {"degree": 2}}})  # the tiny digits model


def test_a_run_explored_by_an_sp_group_equals_one_explored_by_a_plain_worker(tmp_path, parts):
    plain = make_run(parts, tmp_path / "plain", degree=1)
    sp = make_run(parts, tmp_path / "sp", degree=2)
    # m1 dies mid-seed in the middle of explore(1)'s first unit, after the group loaded theta_1
    first = sum(plan_exploration(sp.cfg, 0, iteration_prompts(sp.cfg, 0), PlannerState())["counts"])
    launcher, _ = start_group(tmp_path, sp, {"m0": {}, "m1": {"die_at_call": (first + 2) * STEPS + 2}}, degree=2)
    for run, pool in ((plain, False), (sp, True)):  # plain: this process explores with the plain worker's code
        stages.explore(run, 0, pool=pool)
        stages.update(run, 0)
        stages.explore(run, 1, pool=pool)
    mark_pool_done(sp.store, "the test is over")
    assert exit_codes(launcher, tmp_path, 120) == {"m0": 0, "m1": -signal.SIGKILL}

    key = sp.key("update", 0)  # the filter kept the same seeds: the same theta_1
    assert sp.store.load(key).read("policy.safetensors") == plain.store.load(key).read("policy.safetensors")
    interrupted = []
    for t in (0, 1):
        a = sp.store.load(sp.key("explore", t)).json("explored.json")
        b = plain.store.load(plain.key("explore", t)).json("explored.json")
        assert a["prompts"] == b["prompts"] and a["seeds"] == b["seeds"]
        if t == 0:
            assert sum(map(len, a["seeds"])) == first
        diff = max(abs(x - y) for ra, rb in zip(a["rewards"], b["rewards"]) for x, y in zip(ra, rb))
        assert diff < REWARD_TOL, (t, diff)
        queue = exploration.queue_for(sp, t)
        for item in queue.items():  # one record per unit, by the group; every item completed once
            assert sp.store.list(f"{queue.prefix}/units/{item['id']}") == sorted(item["units"])
            assert queue.done_by(item["id"]) == f"sp-{GROUP}"
            for unit in item["units"]:
                recs = seed_records(sp.store, queue, unit)
                assert [recs[k]["seed"] for k in range(len(recs))] == item["batches"][unit]
                if {r["degree"] for r in recs.values()} == {1, 2}:
                    interrupted.append((t, unit))
    assert [t for t, _ in interrupted] == [1], "the kill must land mid-unit in explore(1)"
    stats = group_stats(sp, ["m0"])["m0"]
    assert stats["states_loaded"] == [1] and stats["recomputed"] == 0 and not stats["left"]
    assert stats["units"] == sum(len(it["units"]) for t in (0, 1) for it in exploration.queue_for(sp, t).items())


def valid(processes: int) -> int:
    return context.largest_valid_degree(min(processes, 4), "ulysses", 4, {"image": 64, "text": 32})


def test_elastic_group_survives_kill_join_and_leave(tmp_path, parts):
    run = make_run(parts, tmp_path / "run", degree=4)
    queue = publish(run, 0, PROMPTS, [[1000 * i + k for k in range(SEEDS_PER_PROMPT)] for i in range(len(PROMPTS))])
    arrive = tmp_path / "replacement-arrives"
    launcher, pids = start_group(tmp_path, run, {
        "m0": {}, "m1": {}, "m2": {"die_at_call": 5 * STEPS + 3}, "m3": {},
        "m4": {"weights": "peer", "arrive": str(arrive), "pretrained": str(parts["weightless"])}}, degree=4)
    rdv = Rendezvous(run.store, group_prefix(GROUP), "observer", SequenceParallelSection(), lambda d: True)
    deadline = time.monotonic() + 240
    wait_for("the regroup after the kill", lambda: (g := rdv.latest()) is not None and g.number >= 1,
             deadline, launcher)
    arrive.touch()
    wait_for("the replacement to join", lambda: "m4" in rdv.latest().members, deadline, launcher)
    joined = rdv.latest()
    wait_for("a seed rolled out with the replacement", lambda: run.store.exists(
        f"{group_prefix(GROUP)}/working/{joined.number:06d}"), deadline, launcher)
    leaver = next(m for m in joined.members[1:] if m != "m4")
    os.kill(pids[leaver], signal.SIGTERM)
    wait_for("the exploration", queue.drained, deadline, launcher)
    mark_pool_done(run.store, "the test is over")
    codes = exit_codes(launcher, tmp_path, max(deadline - time.monotonic(), 1))
    assert codes == {"m0": 0, "m1": 0, "m2": -signal.SIGKILL, "m3": 0, "m4": 0}

    # the group's history: every generation has the largest valid degree of the processes it had
    gens = rdv.generations()
    assert gens[0].members == ("m0", "m1", "m2", "m3") and gens[0].degree == 4
    assert all(g.degree == valid(len(g.members) + len(g.spares)) for g in gens)
    assert all("m2" not in g.members for g in gens[1:])
    assert gens[1].degree == 2 and len(gens[1].spares) == 1  # 3 survivors: 3 does not divide 4 heads
    assert joined.degree == 4 and joined.receivers == ("m4",)
    after = [g for g in gens if g.number > joined.number]
    assert after and all(leaver not in g.members for g in after)
    assert run.store.exists(f"{group_prefix(GROUP)}/left/{leaver}")

    seeds = check_queue(run, queue, ["m0", "m1", "m3", "m4"])
    stats = group_stats(run, ["m0", "m1", "m3", "m4"])
    assert stats[leaver]["left"] and stats["m4"]["seeds"] > 0
    assert stats["m4"]["weights_received"]["from"] == joined.members[0]
    assert stats["m4"]["weights_received"]["bytes"] > 0 and not list(parts["weightless"].rglob("*.safetensors"))
    assert {r["degree"] for recs in seeds.values() for r in recs.values()} == {2, 4}


def test_killed_leader_unit_resumes_from_its_last_committed_seed(tmp_path, parts):
    """The leader holds the lease (in the group's name) and hosts the generation's store: when it dies, the
    survivors regroup under a new leader, which frees the lease at once (not after placement.lease_seconds)
    and continues the unit from its committed seeds, decoding their latents."""
    run = make_run(parts, tmp_path / "run", degree=4, lease_seconds=600)
    queue = publish(run, 0, PROMPTS[:2], [[500 + k for k in range(8)], [600 + k for k in range(8)]])
    launcher, _ = start_group(tmp_path, run, {"m0": {"die_at_call": 2 * STEPS + 2}, "m1": {}, "m2": {}, "m3": {}},
                              degree=4)
    watcher = threading.Thread(target=lambda: (wait_for("the exploration", queue.drained,
                                                        time.monotonic() + 240, launcher),
                                               mark_pool_done(run.store, "the test is over")))
    watcher.start()
    assert exit_codes(launcher, tmp_path, 240) == {"m0": -signal.SIGKILL, "m1": 0, "m2": 0, "m3": 0}
    watcher.join()
    gens = Rendezvous(run.store, group_prefix(GROUP), "observer", SequenceParallelSection(), lambda d: True).generations()
    assert gens[1].members[0] != "m0" and all("m0" not in g.members for g in gens[1:])
    seeds = check_queue(run, queue, ["m1", "m2", "m3"])
    interrupted = [u for u, recs in seeds.items() if {r["generation"] for r in recs.values()} == {0, 1}]
    assert [sorted(r["members"][0] for r in seeds[u].values()) for u in interrupted] == \
        [["m0", "m0", gens[1].members[0], gens[1].members[0]]]  # two seeds before the kill, two after


def test_the_local_pool_runs_an_sp_explorer_group(tmp_path, parts):
    """``placement.sequence_parallel.degree: 2``: the pool's explorer slot is the group's launcher (the
    real one: generated member names, the ready record, SIGTERM passed on), whose members explore."""
    run = make_run(parts, tmp_path / "run", degree=2)
    with worker_pool(run.cfg) as pool:
        assert pool.command("local-explorer-0")[:3] == [sys.executable, "-m", "spotlight.sequence_parallel.launch"]
        stages.explore(run, 0, pool=True)
        launcher = pool.procs["local-explorer-0"]
    assert launcher.returncode == 0, pool.log_tail("local-explorer-0")
    ready = run.store.get_json("workers/local-explorer-0.json")
    assert ready["pid"] == launcher.pid and len(ready["members"]) == 2
    group = Rendezvous(run.store, group_prefix("local-explorer-0"), "observer", SequenceParallelSection(),
                       lambda d: True)
    assert group.generations()[0].members == tuple(sorted(ready["members"]))
    queue = exploration.queue_for(run, 0)
    assert queue.drained() and {queue.done_by(it["id"]) for it in queue.items()} == {"sp-local-explorer-0"}
    stats = [run.store.get_json(f"{group_prefix('local-explorer-0')}/stats/{m}") for m in ready["members"]]
    assert sum(s["units"] for s in stats) == sum(len(it["units"]) for it in queue.items())
