"""The GPU memory each worker kind of a run needs, computed before anything is rented.

``spotlight plan --config C`` prints it; a run or a resume that would place a worker on an accelerator
too small for it drops that accelerator from the worker's ``any_of``, and fails before anything launches
when none is left (:func:`fit_placement`). Nothing is guessed and no weight file is needed:

- **Weights** (by module and dtype): the real pipeline's modules built on ``meta`` from its
  ``config.json`` files (:mod:`spotlight.models.meta`: ``model.pretrained`` when it is on this machine,
  else the published architecture ``model.architecture`` names), cast as ``from_pretrained`` casts them
  (``model.dtype``: bf16 on CUDA), and the reward models as their builders load them (fp32).
- **Training state** (trainer): the adapter (fp32), its gradients, AdamW's two moments, the EMA copy when
  the recipe keeps one; with full fine-tuning the transformer's own, plus theta_0's copy when the KL term
  needs it on the device.
- **Activations**: each phase of a worker's work runs the policy's own code (``guided_velocity`` with CFG,
  ``step_log_prob`` and its backward, ``decode``, the text encoders, the reward's vision tower) on fake
  tensors at the config's batch and resolution, with :class:`spotlight.memory.LiveBytes` booking every
  storage an op allocates and freeing it when autograd or Python does; a phase's peak is the most alive at
  once, with and without gradient checkpointing for the update.
- **Held**: what a phase keeps across its batches, from shapes (the update's rollouts: latents of every
  step, decoded images, prompt embeddings; an evaluation's images).

A worker needs ``weights + training state + max over phases (held + peak)``, plus what the allocator
adds (:data:`FRAGMENTATION` of that, and :data:`CUDA_CONTEXT_BYTES`), against the catalog's memory per
GPU. ``bench/real_scale.py`` checks the activation figures against an allocator's own peak.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from spotlight import catalog
from spotlight.config import Config, ConfigError, config_from_dict
from spotlight.memory import CUDA_BLOCK_BYTES, GIB, LiveBytes, bytes_by_dtype, gib, module_tensors
from spotlight.models.policy import DiffusionPolicy, PromptEmbeds, build_policy

#: what the CUDA caching allocator reserves beyond the peak it hands out (split and freed blocks that no later
#: request fits), with the expandable segments ``spotlight`` sets: measured 1.083 on an H200 (SD3.5-Medium, one
#: iteration, ``bench/real_scale.py``; 1.309 without them)
FRAGMENTATION = 0.10
#: the CUDA context, cuBLAS/cuDNN workspaces and kernels: device memory outside ``max_memory_allocated``
CUDA_CONTEXT_BYTES = int(0.75 * GIB)
#: reward models as the reward builders load them (``spotlight/clip_rewards.py``: fp32 whatever the file)
REWARD_DTYPE = torch.float32
#: the published reward architectures (``configs/architectures``) used when the reward's folder is absent
REWARD_ARCHITECTURES = {"pickscore": "pickscore", "clip_score": "clip-vit-large-patch14",
                        "aesthetic": "clip-vit-large-patch14"}
#: the reward runtime's batch buckets (``spotlight.reward_runtime.make_scorer``)
REWARD_BUCKETS = (1, 8, 32, 128)
KINDS = ("trainer", "explorer")


@dataclass(frozen=True)
class Part:
    """Bytes of one named thing a worker holds."""

    name: str
    bytes: int


@dataclass(frozen=True)
class Phase:
    """One step of a worker's work: the peak of what it allocates, over what it holds meanwhile."""

    name: str
    peak: int
    held: tuple[Part, ...] = ()

    @property
    def total(self) -> int:
        return self.peak + sum(p.bytes for p in self.held)


@dataclass(frozen=True)
class WorkerMemory:
    """What one process (one GPU) of a worker kind holds, and so needs."""

    kind: str  # trainer | explorer | explorer (sequence-parallel member)
    weights: tuple[Part, ...]  # frozen weights, by module and dtype
    training: tuple[Part, ...]  # adapter, gradients, optimizer state, EMA, reference copy
    phases: tuple[Phase, ...]
    notes: tuple[str, ...] = ()

    @property
    def static(self) -> int:
        return sum(p.bytes for p in (*self.weights, *self.training))

    @property
    def worst(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    @property
    def allocated(self) -> int:
        """The allocator's peak: what ``torch.cuda.max_memory_allocated`` would report."""
        return self.static + self.worst.total

    @property
    def need(self) -> int:
        """What the GPU must have: the allocated peak, fragmentation and the CUDA context."""
        return int(self.allocated * (1 + FRAGMENTATION)) + CUDA_CONTEXT_BYTES

    @property
    def weight_bytes(self) -> int:
        """Bytes of weights this worker loads from storage (model folder, reward weights)."""
        return sum(p.bytes for p in self.weights)


@dataclass(frozen=True)
class Fit:
    accelerator: str
    memory: int | None  # bytes per GPU, as the catalog states it (None: it states none; not checked)
    need: int

    @property
    def fits(self) -> bool:
        return self.memory is None or self.need <= self.memory


def gpu_memory(accelerator: str) -> int | None:
    """Bytes per GPU of an accelerator from the shipped catalog; None where it states none."""
    try:
        return int(catalog.gpu_memory_gib(accelerator) * GIB)
    except catalog.CatalogError:
        return None


@dataclass(frozen=True)
class MemoryPlan:
    source: str  # where the architecture was read
    dtype: str
    workers: dict[str, WorkerMemory]  # by placement kind (trainer, explorer)
    fits: dict[str, tuple[Fit, ...]]  # by placement kind, one per candidate accelerator
    peaks: dict[str, int]  # every activation peak computed, by what was run (e.g. "train step (with ...)")

    def dropped(self, kind: str) -> list[Fit]:
        return [f for f in self.fits.get(kind, ()) if not f.fits]


# -- building the policy and the rewards --------------------------------------------------------------
def plan_dtype(cfg: Config) -> torch.dtype:
    """The weights' dtype on a GPU worker: ``model.dtype`` (auto is bf16 on CUDA; the tiny model is fp32 anywhere)."""
    return torch.float32 if cfg.model.dtype == "float32" or cfg.model.kind == "tiny-mmdit" else torch.bfloat16


def planning_policy(cfg: Config, dtype: torch.dtype) -> DiffusionPolicy:
    """The configured policy on ``meta`` (a pipeline) or as built (the tiny model: kilobytes)."""
    if cfg.model.kind == "tiny-mmdit":
        return build_policy(cfg)
    from spotlight.models.meta import policy_on_meta

    return policy_on_meta(cfg, dtype=dtype)


def reward_folder(cfg: Config, name: str) -> Path:
    """The reward's model folder when it is on this machine, else its published architecture."""
    from spotlight.models.meta import ARCHITECTURES_DIR

    section = getattr(cfg.rewards, name)
    path = Path(section.clip_model if name == "aesthetic" else section.model)
    return path if (path / "config.json").is_file() else ARCHITECTURES_DIR / REWARD_ARCHITECTURES[name]


def reward_model_on_meta(cfg: Config, name: str) -> nn.Module | None:
    """The GPU model of a registry reward, on ``meta`` in the dtype its builder loads it (None: the reward
    has none on the GPU: remote, JPEG, or the digit classifiers, which are kilobytes)."""
    if name not in REWARD_ARCHITECTURES:
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, CLIPModel

    with init_empty_weights():
        clip = CLIPModel(AutoConfig.from_pretrained(reward_folder(cfg, name)))
    if name == "aesthetic":
        from spotlight.clip_rewards import AestheticHead

        with init_empty_weights():
            clip.add_module("aesthetic_head", AestheticHead(clip.config.projection_dim))
    return clip.to(REWARD_DTYPE)


# -- the phases, on fake tensors ----------------------------------------------------------------------
def _embeds(policy: DiffusionPolicy, rows: int) -> PromptEmbeds:
    return PromptEmbeds({k: torch.zeros(rows, *shape, dtype=dtype, device=policy.device)
                         for k, (shape, dtype) in policy.prompt_shapes().items()})


def rollout_forward(policy: DiffusionPolicy, rows: int, guidance: float, tracker: LiveBytes) -> None:
    """One guided velocity of a rollout batch (the conditional and unconditional passes share a batch)."""
    x = torch.zeros(rows, *policy.latent_shape, device=policy.device)
    uncond = _embeds(policy, rows) if policy.needs_uncond(guidance) else None
    with torch.no_grad():
        policy.guided_velocity(x, torch.full((rows,), 0.5), _embeds(policy, rows), uncond, guidance)


def decode_batch(policy: DiffusionPolicy, rows: int, tracker: LiveBytes) -> None:
    with torch.no_grad():
        policy.decode(torch.zeros(rows, *policy.latent_shape, device=policy.device))


def train_step(policy: DiffusionPolicy, rows: int, guidance: float, noise_level: float, steps: int,
                checkpointing: bool, tracker: LiveBytes) -> None:
    """``step_log_prob`` of a microbatch and its backward, as ``grpo_epoch`` runs them (gradients exist).
    ``checkpointing``: what the transformer is set to (it keys the memo of :class:`_Peaks`)."""
    from spotlight.sampler import step_log_prob

    x = torch.zeros(rows, *policy.latent_shape, device=policy.device)
    uncond = _embeds(policy, rows) if policy.needs_uncond(guidance) else None
    sigmas = torch.linspace(1, 0, steps + 1)
    log_prob, _ = step_log_prob(policy, x, torch.zeros_like(x), torch.zeros(rows, dtype=torch.long), _embeds(policy, rows),
                                uncond, sigmas, noise_level, guidance)
    tracker.mark("forward")
    log_prob.mean().backward()


def text_encode(module: nn.Module, tokens: int, tracker: LiveBytes) -> None:
    """A text encoder on one prompt, as the pipelines call it (all hidden states returned)."""
    with torch.no_grad():
        module(input_ids=torch.zeros(1, tokens, dtype=torch.long), output_hidden_states=True)


def reward_forward(clip: nn.Module, images: int, resolution: int, tracker: LiveBytes) -> None:
    """The reward's image side on ``images`` decoded images: resized to CLIP's input, vision tower, projection."""
    with torch.no_grad():
        pixels = torch.zeros(images, 3, resolution, resolution)
        side = clip.config.vision_config.image_size
        pixels = nn.functional.interpolate(pixels, size=(side, side), mode="bilinear")
        embeds = nn.functional.normalize(clip.visual_projection(clip.vision_model(pixel_values=pixels).pooler_output), dim=-1)
        if hasattr(clip, "aesthetic_head"):  # as ClipImageEmbedder scores
            clip.aesthetic_head(embeds)


def _peak(fn, *args) -> tuple[int, dict[str, int]]:
    """The live-bytes peak (CUDA's 512-byte blocks) of ``fn(*args, tracker)``, on the fake tensors it is given."""
    tracker = LiveBytes(CUDA_BLOCK_BYTES)
    with tracker:
        fn(*args, tracker)
    return tracker.peak, dict(tracker.marks)


class _Peaks(dict):
    """Phase peaks by name; one computation per distinct (function, arguments): phases often share one."""

    def __init__(self) -> None:
        super().__init__()
        self._done: dict[tuple, tuple[int, dict[str, int]]] = {}

    def run(self, name: str, fn, *args) -> dict[str, int]:
        key = (fn.__name__, *(id(a) if isinstance(a, nn.Module) else a for a in args))
        if key not in self._done:
            self._done[key] = _peak(fn, *args)
        self[name] = self._done[key][0]
        return self._done[key][1]


# -- the plan -----------------------------------------------------------------------------------------
def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _module_parts(name: str, module: nn.Module, skip: set[int] = frozenset()) -> list[Part]:
    """A module's weights as one part, named with its dtypes (``skip``: ids of parameters counted elsewhere)."""
    by_dtype = bytes_by_dtype([t for t in module_tensors(module) if id(t) not in skip])
    ranked = sorted(by_dtype.items(), key=lambda kv: -kv[1])  # the bulk's dtype, then any other of a MiB or more
    dtypes = "/".join(_dtype_name(d) for i, (d, n) in enumerate(ranked) if i == 0 or n >= 2**20)
    return [Part(f"{name} ({dtypes})", sum(by_dtype.values()))]


def _bucket(images: int) -> int:
    """The batch the reward runtime feeds its model for ``images`` images (chunks of the largest bucket)."""
    return next(b for b in REWARD_BUCKETS if b >= min(images, REWARD_BUCKETS[-1]))


def _tensor_part(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> Part:
    n = 1
    for s in shape:
        n *= s
    return Part(name, n * torch.empty((), dtype=dtype).element_size())


def _eval_images(cfg: Config) -> int:
    """Images an evaluation samples: ``evaluation.prompts`` x seeds, or every held-out prompt when that is
    null (read from the prompt set; the update's size if the set is not on this machine)."""
    if cfg.evaluation.prompts is not None:
        return cfg.evaluation.prompts * cfg.evaluation.seeds_per_prompt
    from spotlight.prompts import evaluation_prompts

    try:
        return len(evaluation_prompts(cfg)[0])
    except (ConfigError, OSError):
        return cfg.grpo.prompts_per_iteration * cfg.grpo.group_size


def _ema_on(cfg: Config, ema: bool | None) -> bool:
    """EMA of the trainable state: ``ema`` if given, else whether the recipe's ``grpo.ema`` is on."""
    return cfg.grpo.ema is not None if ema is None else ema


def plan_memory(cfg: Config, ema: bool | None = None) -> MemoryPlan:
    """The memory plan of ``cfg`` for GPU workers. ``ema``: count an EMA copy of the trainable state (default:
    the config's ``grpo.ema``)."""
    degree, explorers = cfg.placement.sequence_parallel.degree, cfg.placement.explorer.workers > 0
    recipe = {k: v for k, v in cfg.recipe().items() if k != "run"}  # store URLs, seeds, threads: no bytes
    workers, source, dtype, peaks = _workers(json.dumps(recipe, sort_keys=True), degree, explorers,
                                             _ema_on(cfg, ema))
    fits = {kind: tuple(Fit(a, gpu_memory(a), w.need) for a in getattr(cfg.placement, kind).accelerators)
            for kind, w in workers.items()}
    return MemoryPlan(source, dtype, workers, fits, dict(peaks))


@lru_cache(maxsize=16)
def _workers(recipe_json: str, degree: int, explorers: bool, ema: bool
             ) -> tuple[dict[str, WorkerMemory], str, str, dict[str, int]]:
    """What each worker kind holds: depends on the recipe, the sequence-parallel degree and whether there are
    explorers, not on the accelerators (so a placement change reuses it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = config_from_dict(json.loads(recipe_json))
    dtype = plan_dtype(cfg)
    policy = planning_policy(cfg, dtype)
    core = policy.core
    lora = [p for n, p in core.named_parameters() if "lora_" in n]
    trainable = lora if cfg.model.lora is not None else list(core.parameters())
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    weights = _module_parts("transformer", core, {id(p) for p in lora})
    for name, module in policy.frozen_modules().items():
        weights += _module_parts(name, module)
    adapter = [Part("LoRA adapter (float32)", trainable_bytes)] if lora else []
    rewards = {which: [n for n in getattr(cfg.rewards, which)] for which in ("train", "eval")}
    reward_models = {n: reward_model_on_meta(cfg, n) for n in cfg.rewards.names()}
    reward_parts = {n: _module_parts(f"reward {n}", m) for n, m in reward_models.items() if m is not None}

    sc, gc_, ec = cfg.sampler, cfg.grpo, cfg.exploration
    n_update = gc_.prompts_per_iteration * gc_.group_size
    rollout_rows = sc.batch_size or n_update
    n_eval = _eval_images(cfg)
    resolution = getattr(cfg.model, "resolution", policy.latent_shape[-1])
    image_shape = cfg.model.image_shape
    cfg_rows = 2 if policy.needs_uncond(sc.guidance) else 1
    peaks = _Peaks()
    with FakeTensorMode(allow_non_fake_inputs=True):
        policy.to_empty(device="cpu")
        for m in reward_models.values():
            if m is not None:
                m.to_empty(device="cpu")
        for p in trainable:
            p.grad = torch.zeros_like(p)  # the update holds gradients from its first microbatch on
        policy.eval()
        peaks.run("rollout (update)", rollout_forward, policy, rollout_rows, sc.guidance)
        peaks.run("rollout (exploration)", rollout_forward, policy, ec.seeds_per_batch, sc.guidance)
        peaks.run("decode (update)", decode_batch, policy, rollout_rows)
        peaks.run("decode (exploration)", decode_batch, policy, ec.seeds_per_batch)
        policy.train()
        gc_setting = hasattr(core, "enable_gradient_checkpointing")
        for checkpointing in ((True, False) if gc_setting else (False,)):
            if gc_setting:
                core.enable_gradient_checkpointing() if checkpointing else core.disable_gradient_checkpointing()
            peaks.run(f"train step ({'with' if checkpointing else 'without'} gradient checkpointing)", train_step,
                      policy, gc_.microbatch_size or n_update, sc.guidance, sc.noise_level, sc.train_steps, checkpointing)
        policy.eval()
        for name, tokens in policy.text_lengths().items():
            peaks.run(f"text encoding ({name})", text_encode, policy.frozen_modules()[name], tokens)
        for name, m in reward_models.items():
            if m is not None:
                for rows in sorted({n_update, _bucket(n_update), _bucket(ec.seeds_per_batch), _bucket(n_eval)}):
                    peaks.run(f"reward {name} ({rows} images)", reward_forward, m, rows, resolution)
        for p in trainable:
            p.grad = None

    text_peak = max([v for k, v in peaks.items() if k.startswith("text encoding")], default=0)
    checkpointing = bool(cfg.model.gradient_checkpointing) and gc_setting
    train_key = f"train step ({'with' if checkpointing else 'without'} gradient checkpointing)"
    other_key = f"train step ({'without' if checkpointing else 'with'} gradient checkpointing)"

    def embeds(rows: int, name: str) -> list[Part]:
        parts = []
        for k, (shape, dt) in policy.prompt_shapes().items():
            parts.append(_tensor_part(f"{name} prompt embeddings {k}", (rows * cfg_rows, *shape), dt))
        return parts

    latent = policy.latent_shape
    update_held = (_tensor_part(f"update rollouts: latents ({n_update} x {sc.train_steps + 1} steps)",
                                (n_update, sc.train_steps + 1, *latent), torch.float32),
                   _tensor_part(f"update rollouts: images ({n_update})", (n_update, *image_shape), torch.float32),
                   *embeds(n_update, "update"))

    def reward_phases(which: str, images: int, held: tuple[Part, ...], built: set[str]) -> list[Phase]:
        out = []
        for name in rewards[which]:
            if reward_models.get(name) is None:
                continue
            chunk = _bucket(images)
            out.append(Phase(f"reward {name} ({which}), {chunk} images per call", peaks[f"reward {name} ({chunk} images)"],
                             held))
            if name not in built:  # the scorer checks its runtime on one batch of the update's size when built
                built.add(name)
                parity = (_tensor_part(f"reward {name} parity batch ({n_update} images)", (n_update, *image_shape),
                                       torch.float32),)
                out.append(Phase(f"reward {name} built (parity batch of {n_update})",
                                 peaks[f"reward {name} ({n_update} images)"], parity))
        return out

    rollouts = update_held[:2]  # the embeddings of every row are encoded after the rewards, for the steps
    trainer_phases = [
        Phase(f"update rollout, {rollout_rows} per batch x{cfg_rows} (CFG)", peaks["rollout (update)"], rollouts),
        Phase(f"update decode, {rollout_rows} per batch", peaks["decode (update)"], rollouts),
        Phase("update rollouts gathered (Rollout.cat: the batches and their concatenation)", 0,
              (*rollouts, *(Part(f"{p.name}, concatenated", p.bytes) for p in rollouts))),
        Phase(f"update {train_key}, {gc_.microbatch_size or n_update} rows x{cfg_rows} (CFG)", peaks[train_key],
              update_held),
        Phase(f"evaluation sampling, {rollout_rows} per batch", peaks["rollout (update)"],
              (_tensor_part(f"evaluation images ({n_eval})", (n_eval, *image_shape), torch.float32),)),
        Phase("text encoding (one prompt)", text_peak),
        *reward_phases("train", n_update, rollouts, built := set()),
        *reward_phases("eval", n_eval, (_tensor_part(f"evaluation images ({n_eval})", (n_eval, *image_shape),
                                                     torch.float32),), built),
    ]
    training = list(adapter)
    if cfg.model.lora is None:
        training = [Part(f"transformer gradients ({_dtype_name(dtype)})", trainable_bytes),
                    Part(f"AdamW moments ({_dtype_name(dtype)})", 2 * trainable_bytes)]
    else:
        training += [Part("LoRA gradients (float32)", trainable_bytes), Part("AdamW moments (float32)", 2 * trainable_bytes)]
    if cfg.grpo.kl_beta > 0 and cfg.grpo.kl_reference == "ema":  # weights_swapped holds the live weights aside
        training.append(Part("live weights' copy, EMA swapped in (KL)", trainable_bytes))
    elif cfg.grpo.kl_beta > 0 and cfg.model.lora is None:
        training.append(Part("theta_0 reference copy (KL)", trainable_bytes))
    if ema:
        training.append(Part("EMA of the trainable state", trainable_bytes))
    trainer_rewards = [p for n in dict.fromkeys(rewards["train"] + rewards["eval"]) for p in reward_parts.get(n, [])]
    notes = [f"{other_key}: {gib(peaks[other_key])} GiB (configured: {train_key})"] if gc_setting else []
    trainer = WorkerMemory("trainer", tuple(weights + trainer_rewards), tuple(training), tuple(trainer_phases),
                           tuple(notes))

    explore_latents = _tensor_part(f"exploration rollouts: latents ({ec.seeds_per_batch} x {cfg.exploration_steps + 1})",
                                   (ec.seeds_per_batch, cfg.exploration_steps + 1, *latent), torch.float32)
    explorer_rewards = [p for n in rewards["train"] for p in reward_parts.get(n, [])]
    explorer_phases = [
        Phase(f"exploration rollout, {ec.seeds_per_batch} seeds x{cfg_rows} (CFG)", peaks["rollout (exploration)"],
              (explore_latents,)),
        Phase(f"exploration decode, {ec.seeds_per_batch}", peaks["decode (exploration)"], (explore_latents,)),
        Phase("text encoding (one prompt)", text_peak),
        *reward_phases("train", ec.seeds_per_batch, (), set()),
    ]
    explorer_notes: tuple[str, ...] = ()
    kind = "explorer"
    if degree > 1:
        kind = f"explorer (sequence-parallel member, degree {degree})"
        explorer_phases[0] = Phase(f"one seed's rollout x{cfg_rows} (CFG), tokens split {degree} ways",
                                   -(-peaks["rollout (exploration)"] // (ec.seeds_per_batch * degree)), ())
        explorer_notes = ("a member's rollout is the one-seed figure divided by the degree: context parallelism "
                          "splits every token sequence (Ulysses: attention over all tokens with 1/degree of the heads, "
                          "the same bytes); its all-to-all buffers are left out",)
    explorer = WorkerMemory(kind, tuple(weights + explorer_rewards), tuple(adapter), tuple(explorer_phases),
                            explorer_notes)

    workers = {"trainer": trainer}
    if cfg.exploration.mode != "none" and explorers:
        workers["explorer"] = explorer
    if cfg.model.kind == "tiny-mmdit":
        source = "the config's tiny MMDiT (built in full: kilobytes)"
    else:
        from spotlight.models.meta import ARCHITECTURES_DIR, model_folder

        folder = model_folder(cfg.model)
        repo = ARCHITECTURES_DIR.parent.parent
        source = str(folder.relative_to(repo) if folder.is_relative_to(repo) else folder)
    return workers, source, _dtype_name(dtype), dict(peaks)


def worker_weight_bytes(cfg: Config, kind: str) -> int:
    """Bytes of weights a worker of ``kind`` (trainer or explorer) loads when it boots: the pipeline's
    modules in ``model.dtype`` and its reward models (what the forecast's boot time divides by bandwidth).
    Built on meta only: no activation is counted, so it is fast."""
    return _weight_bytes(cfg.model_dump_json(), kind)


@lru_cache(maxsize=32)
def _weight_bytes(config_json: str, kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"worker kind {kind!r}: expected one of {', '.join(KINDS)}")
    cfg = config_from_dict(json.loads(config_json))
    policy = planning_policy(cfg, plan_dtype(cfg))
    lora = {id(p) for n, p in policy.core.named_parameters() if "lora_" in n}
    total = sum(p.bytes for p in _module_parts("transformer", policy.core, lora))
    total += sum(p.bytes for name, m in policy.frozen_modules().items() for p in _module_parts(name, m))
    names = list(cfg.rewards.train) + (list(cfg.rewards.eval) if kind == "trainer" else [])
    return total + sum(reward_weight_bytes(cfg, name) or 0 for name in dict.fromkeys(names))


def reward_weight_bytes(cfg: Config, name: str) -> int | None:
    """Bytes of a reward model's weights as its builder loads them; None for a reward with no model here."""
    model = reward_model_on_meta(cfg, name)
    return None if model is None else sum(p.bytes for p in _module_parts(name, model))


# -- placement ----------------------------------------------------------------------------------------
def fit_placement(cfg: Config, plan: MemoryPlan | None = None) -> tuple[Config, list[str]]:
    """``cfg`` with every accelerator that cannot hold its worker dropped from the worker's candidates, and
    a line per drop. A worker kind left with none is a ConfigError naming the worker, what it needs and
    each accelerator's memory: raised before anything launches."""
    plan = plan or plan_memory(cfg)
    placement = cfg.placement.model_dump(mode="json")
    lines, problems = [], []
    for kind, fits in plan.fits.items():
        worker = plan.workers[kind]
        kept = [f.accelerator for f in fits if f.fits]
        for f in plan.dropped(kind):
            lines.append(f"{kind}: dropped {f.accelerator} ({gib(f.memory)} GiB per GPU; the {worker.kind} needs "
                         f"{gib(f.need)} GiB)")
        if not kept:
            problems.append(f"the {worker.kind} needs {gib(worker.need)} GiB per GPU "
                            f"({gib(worker.allocated)} GiB allocated at its peak, {worker.worst.name}), but "
                            + ", ".join(f"{f.accelerator} has {gib(f.memory)} GiB (short by {gib(f.need - f.memory)})"
                                        for f in fits))
        placement[kind]["accelerators"] = kept or placement[kind]["accelerators"]
    if problems:
        raise ConfigError("placement: no accelerator can hold the worker:\n  " + "\n  ".join(problems)
                          + "\n(spotlight plan --config ... prints each part; list larger accelerators, or lower "
                          "sampler.batch_size, grpo.microbatch_size or model.resolution)")
    return cfg.with_placement(placement), lines


# -- the report ---------------------------------------------------------------------------------------
def format_plan(plan: MemoryPlan) -> str:
    """Plain text, GiB (2^30 bytes): per worker kind its parts, its phases, its need and which accelerators hold it."""
    lines = [f"memory plan (GiB per GPU; weights in {plan.dtype}; architecture from {plan.source})"]
    for kind, w in plan.workers.items():
        lines.append(f"{w.kind}: needs {gib(w.need)} GiB = {gib(w.allocated)} allocated at peak "
                     f"+ {FRAGMENTATION:.0%} fragmentation + {gib(CUDA_CONTEXT_BYTES)} CUDA context")
        lines.append(f"  weights             {gib(sum(p.bytes for p in w.weights)):>8}")
        lines += [f"    {p.name:<44} {gib(p.bytes):>8}" for p in w.weights]
        if w.training:
            lines.append(f"  training state      {gib(sum(p.bytes for p in w.training)):>8}")
            lines += [f"    {p.name:<44} {gib(p.bytes):>8}" for p in w.training]
        lines.append("  activations per phase (peak above what it holds; the largest total counts):")
        for ph in w.phases:
            star = "*" if ph is w.worst else " "
            held = f"  + held {gib(sum(p.bytes for p in ph.held))}" if ph.held else ""
            lines.append(f"   {star}{ph.name:<66} {gib(ph.peak):>8}{held}")
        worst_held = [p for p in w.worst.held]
        if worst_held:
            lines.append("  held during the peak phase:")
            lines += [f"    {p.name:<44} {gib(p.bytes):>8}" for p in worst_held]
        lines += [f"  note: {n}" for n in w.notes]
        for f in plan.fits.get(kind, ()):
            if f.memory is None:
                lines.append(f"  {f.accelerator:<14} {'?':>8} GiB  kept: the catalog states no memory for it")
                continue
            verdict = "fits" if f.fits else f"too small: short by {gib(f.need - f.memory)} GiB (dropped)"
            lines.append(f"  {f.accelerator:<14} {gib(f.memory):>8} GiB  {verdict}")
    return "\n".join(lines)
