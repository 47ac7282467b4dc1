"""A run: its config, its store, the cache of pretrained parts, and this process's policies and rewards.

A run keeps the recipe it started with (another is refused, naming the differences; its placement may
change between resumes, and each change is recorded). A process holds one policy, loaded once, and
swaps its trainable state per iteration and per use: theta_0 is the base (the pretrained tiny model
from the cache, or the pipeline as loaded, plus a seeded LoRA init), theta_t the state committed by
update(t-1) — with LoRA only the adapter, never the base.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from spotlight.config import Config, ConfigError, config_from_dict, fingerprint
from spotlight.models.policy import DiffusionPolicy, build_policy
from spotlight.rewards import Reward, RewardContext, WeightedReward, build_reward
from spotlight.store import AlreadyExistsError, RunStore, json_bytes

Progress = Callable[[str, int, int], None]
CODE_VERSION = "1"  # bump when a cached stage's computation changes meaning


def no_progress(desc: str, done: int, total: int) -> None:
    pass


@dataclass
class Run:
    """A run: its config, its store, and the cache of pretrained parts shared by runs."""

    cfg: Config
    store: RunStore
    cache: RunStore
    progress: Progress = no_progress
    device: torch.device = torch.device("cpu")  # where this process computes (see `compute_device`)
    _rewards: dict[str, Reward] = field(default_factory=dict)
    _policy: DiffusionPolicy | None = None  # the process's one policy: see `resident_policy`
    _holds: int | None = None  # the theta_t whose trainable state `_policy` holds (None: being trained)
    _states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)  # host copies, see `trainable_state_at`

    # -- keys ------------------------------------------------------------------------------
    @staticmethod
    def key(stage: str, t: int) -> str:
        return f"iterations/{t:04d}/{stage}"

    @property
    def base_key(self) -> str:
        """Cache commit of the pretrained tiny base: its architecture and pretraining, not how RL trains it."""
        arch = self.cfg.model.model_dump(mode="json", exclude={"lora", "dtype", "gradient_checkpointing"})
        digest = fingerprint({"model": arch, "pretrain": self.cfg.pretrain.model_dump(mode="json")})
        return f"base-{digest}-s{self.cfg.run.seed}-v{CODE_VERSION}"

    @property
    def classifiers_key(self) -> str:
        return f"classifiers-{self.cfg.fingerprint('pretrain')}-s{self.cfg.run.seed}-v{CODE_VERSION}"

    def eval_iterations(self) -> list[int]:
        n, every = self.cfg.grpo.iterations, self.cfg.evaluation.every
        return sorted({0, n, *range(every, n, every)})

    # -- policies --------------------------------------------------------------------------
    @property
    def pretrains_base(self) -> bool:
        """The tiny model is pretrained here; pipelines arrive pretrained."""
        return self.cfg.model.kind == "tiny-mmdit"

    def _build(self) -> DiffusionPolicy:
        base = self.cache.load(f"{self.base_key}/final").tensors("ema.safetensors") if self.pretrains_base else None
        return build_policy(self.cfg, self.device, base_state=base)

    def policy_state(self, t: int) -> dict[str, torch.Tensor] | None:
        """theta_t's trainable state as update(t-1) committed it; None for theta_0 (what ``build_policy`` gives)."""
        if t == 0:
            return None
        return self.store.load(self.key("update", t - 1)).tensors("policy.safetensors")

    def resident_policy(self) -> DiffusionPolicy:
        """The one policy of this process, built (the base loaded) the first time it is asked for.

        Every theta_t this process computes with, for inference or training, is this module with theta_t's
        trainable state swapped in (with LoRA only the adapter, a copy into the same tensors), so a process
        holds the frozen base once, whatever it runs: update, evaluate, ranking, a joined exploration.
        theta_0's trainable state is kept to swap back in: with LoRA the adapter's seeded init, on the host;
        with full fine-tuning a copy of the transformer, the one extra copy a process holds (on the host,
        or on the device as the KL reference when the update needs one)."""
        if self._policy is None:
            self._policy = self._build()
            self._states[0] = {k: v.detach().to("cpu", copy=True) for k, v in self._policy.trainable_state().items()}
            self._holds = 0
        return self._policy

    def trainable_state_at(self, t: int) -> dict[str, torch.Tensor]:
        """theta_t's trainable state. With LoRA the two newest read from the store stay in host memory (an
        explorer alternates between theta_{t-1} and theta_t; a few hundred MB at most), beside theta_0's."""
        if t in self._states:
            return self._states[t]
        state = self.policy_state(t)
        if self.cfg.model.lora is not None:
            self._states[t] = state
            newest = sorted(k for k in self._states if k > 0)[-2:]
            self._states = {k: v for k, v in self._states.items() if k == 0 or k in newest}
        return state

    def _holding(self, t: int) -> DiffusionPolicy:
        """The resident policy holding theta_t (its trainable state swapped in unless it holds it already)."""
        policy = self.resident_policy()
        if self._holds != t:
            self._holds = None  # a failed load leaves nothing known
            policy.load_trainable_state(self.trainable_state_at(t))
            self._holds = t
        return policy

    def policy_at(self, t: int) -> DiffusionPolicy:
        """theta_t for inference (exploration, evaluation, ranking): the resident policy in eval mode, holding
        theta_t until the next ``policy_at`` or ``training_policy`` of this run swaps another state in."""
        return self._holding(t).eval()

    def training_policy(self, t: int) -> DiffusionPolicy:
        """The resident policy at theta_t for update(t). Its state is always what the store (or theta_0's
        copy) says, so a resumed process trains exactly what a running one would; training then changes
        it, so the next ``policy_at`` swaps a state in again. Full fine-tuning with a KL term freezes
        theta_0 as the reference once (the copy of theta_0 then lives there, on the device); a KL to the EMA
        (``grpo.kl_reference: ema``) needs no such copy."""
        policy = self._holding(t)
        if self.cfg.grpo.kl_beta > 0 and self.cfg.grpo.kl_reference == "base" and not policy.has_reference:
            policy.load_trainable_state(self._states[0])
            self._states[0] = policy.keep_reference()  # theta_0's copy now lives there: no second one
            policy.load_trainable_state(self.trainable_state_at(t))
        self._holds = None
        return policy

    # -- rewards ---------------------------------------------------------------------------
    def reward(self, name: str) -> Reward:
        if name not in self._rewards:
            context = RewardContext(self.cfg, self.device, self.cache, self.classifiers_key,
                                    self.cfg.model.image_shape)
            self._rewards[name] = build_reward(context, name)
        return self._rewards[name]

    def weighted_reward(self, which: str) -> WeightedReward:
        """``rewards.train`` or ``rewards.eval`` as a weighted sum of registry rewards."""
        weights: dict[str, float] = getattr(self.cfg.rewards, which)
        return WeightedReward(which, {name: (w, self.reward(name)) for name, w in weights.items()})


def distributed() -> bool:
    """Launched as one of several processes (accelerate launch / torchrun set WORLD_SIZE)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def compute_device(name: str) -> torch.device:
    """``run.device`` on this machine: auto is cuda when torch sees a GPU. Under a multi-GPU launch each
    process takes the GPU of its LOCAL_RANK. Asking for a GPU that is not there is an error, early."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"run.device is {name!r} but torch {torch.__version__} sees no CUDA device "
                              f"(built for CUDA {torch.version.cuda}); use run.device=auto or cpu")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) if distributed() else 0)
        if device.index >= torch.cuda.device_count():
            raise ConfigError(f"run.device is {name!r} (index {device.index}) but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s)")
    return device


def check_inputs(cfg: Config) -> None:
    """Everything a run reads from outside its store, checked before any compute (ConfigError naming
    it): the pipeline folder and LoRA targets, the prompt files and the rewards' weights."""
    from spotlight.models.policy import check_pretrained, lora_target_check
    from spotlight.prompts import check_prompts
    from spotlight.rewards import check_rewards

    check_pretrained(cfg.model)
    lora_target_check(cfg.model)
    check_prompts(cfg)
    check_rewards(cfg)


def open_run(cfg: Config, progress: Progress = no_progress, computes: bool = True,
             device: torch.device | None = None) -> Run:
    """Open (or start) the run at cfg's URL. A run keeps the recipe it started with: another is an error.
    Placement (where workers run) and evaluation.target may differ; a placement change is recorded.

    The store URL itself is not part of the comparison: a run may be opened from wherever its store is,
    and ``run.device: auto`` resolves per machine (same numbers for the same device type).
    ``computes`` False: this process only reads and writes the store (the flow's controller, which
    posts the GPU work to the workers), so ``run.device`` need not exist here. ``device``: this process
    computes there instead of on ``run.device`` (a member of a sequence-parallel group: one GPU each).
    """
    if device is None:
        device = compute_device(cfg.run.device) if computes else torch.device("cpu")
    torch.set_num_threads(cfg.run.threads)
    if device.type == "cuda":
        # cuBLAS is deterministic only with a fixed workspace (must be set before its first call);
        # ops without a deterministic CUDA kernel warn (naming the op) instead of stopping a run.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.cuda.set_device(device)
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(True)
    cfg = cfg.resolved()
    store, cache = RunStore(cfg.run_url), RunStore(cfg.cache_url)
    if store.is_committed("config"):
        started = config_from_dict(store.load("config").json("config.json"), f"{store.url}/config")
        started = started.model_copy(update={"run": started.run.model_copy(update={"url": cfg.run_url})})
        if started.recipe() != cfg.recipe():
            raise ConfigError(f"run {store.url} was started with another config; differences:\n"
                              + config_diff(started.recipe(), cfg.recipe())
                              + "\nuse another run.name/run.url, or the original config "
                              "(placement and evaluation.target may change between resumes)")
        record_placement(store, started, cfg)
    else:
        store.commit("config", {"config.json": json_bytes(cfg.model_dump(mode="json"))})
    return Run(cfg, store, cache, progress, device)


PLACEMENT_PREFIX = "placement"


def placement_history(store: RunStore) -> list[dict[str, Any]]:
    """The placement changes a run recorded, oldest first (``placement/NNNN.json``)."""
    names = sorted(n for n in store.list(PLACEMENT_PREFIX) if n.endswith(".json") and n[:-5].isdigit())
    return [store.get_json(f"{PLACEMENT_PREFIX}/{n}") for n in names]


def current_placement(store: RunStore, committed: Config) -> dict[str, Any]:
    """The placement a run uses now: the newest recorded change, else the one it started with."""
    history = placement_history(store)
    return history[-1]["placement"] if history else committed.placement.model_dump(mode="json")


def record_placement(store: RunStore, started: Config, cfg: Config) -> None:
    """A resumed run may move (other workers, GPUs, spot or not, leases): each change is recorded,
    create-only, as ``placement/NNNN.json`` with what changed, so the store says where every part ran."""
    now = cfg.placement.model_dump(mode="json")
    while True:
        history = placement_history(store)
        before = history[-1]["placement"] if history else started.placement.model_dump(mode="json")
        if before == now:
            return
        entry = {"placement": now, "changes": config_diff(before, now).splitlines(), "at": time.time()}
        try:
            store.create_bytes(f"{PLACEMENT_PREFIX}/{len(history) + 1:04d}.json", json_bytes(entry))
            return
        except AlreadyExistsError:  # another process recorded a change first: compare with it
            continue


def run_config(url: str) -> Config:
    """An existing run's committed config, with the placement it uses now (a resumed run may have
    changed it); reads the store only, so a launcher that forks GPU processes can call it."""
    store = RunStore(url)
    if not store.is_committed("config"):
        raise ConfigError(f"no run at {url}: it has no committed config (start it with `spotlight run`)")
    cfg = config_from_dict(store.load("config").json("config.json"), f"{url}/config")
    cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"url": url})})
    return cfg.with_placement(current_placement(store, cfg))


def open_run_from_url(url: str, progress: Progress = no_progress, device: torch.device | None = None) -> Run:
    """Open an existing run from its store URL alone (workers, stage jobs): its committed config says the
    rest (:func:`run_config`). ``device``: as in :func:`open_run`."""
    return open_run(run_config(url), progress, device=device)


def config_diff(a: dict[str, Any], b: dict[str, Any], prefix: str = "") -> str:
    lines = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            sub = config_diff(va, vb, f"{prefix}{k}.")
            lines += [sub] if sub else []
        elif va != vb:
            lines.append(f"  {prefix}{k}: {va!r} (started) vs {vb!r} (now)")
    return "\n".join(lines)
