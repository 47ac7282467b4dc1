"""Where a run's work runs (not what it computes): worker kinds, accelerators, leases, sequence parallelism,
the buckets workers see as folders. May change between resumes of a run; older spellings of these
settings are migrated here."""

from __future__ import annotations

import posixpath
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from spotlight import catalog
from spotlight.config.base import ConfigError, Section

#: model kinds whose diffusers transformer has a ``_cp_plan`` (FluxTransformer2DModel, QwenImageTransformer2DModel)
SEQUENCE_PARALLEL_KINDS = ("flux", "qwen-image")


class SequenceParallelSection(Section):
    """One rollout of a high-resolution image shared by several GPUs (diffusers' context parallelism),
    as an elastic group of persistent processes (spotlight.sequence_parallel; docs/sequence_parallel.md)."""

    degree: int = Field(1, ge=1, description="processes (GPUs) of a group; the first generation forms when this "
                        "many are ready, later ones take the largest valid degree of the processes left")
    mode: Literal["ulysses", "ring"] = Field("ulysses", description="ulysses: all-to-all over heads (the degree "
                                             "must divide the heads); ring: K/V passed around (needs an attention "
                                             "backend that returns the log-sum-exp: CUDA only in diffusers 0.39)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend: auto is nccl "
                                                     "on CUDA, gloo on the CPU")
    attention_backend: str | None = Field(None, description="diffusers attention backend of the transformer; "
                                          "null: native for ulysses, _native_cudnn for ring")
    heartbeat_seconds: float = Field(0.5, gt=0, description="how often a process refreshes its record in the run store")
    dead_after_seconds: float = Field(5.0, gt=0, description="a record older than this: the process is gone")
    regroup_grace_seconds: float = Field(0.25, ge=0, description="after a failure, how long the new leader waits "
                                         "for the other survivors; a later one joins at a unit boundary")
    collective_timeout_seconds: float = Field(30.0, gt=0, description="a collective stuck this long (a hung peer) "
                                              "breaks the group, which then regroups")
    join_timeout_seconds: float = Field(60.0, gt=0, description="forming: wait this long for the first degree "
                                        "processes, and for a generation's members to connect")

    @model_validator(mode="after")
    def _heartbeats(self) -> "SequenceParallelSection":
        if self.dead_after_seconds <= 2 * self.heartbeat_seconds:
            raise ValueError(f"dead_after_seconds ({self.dead_after_seconds}) must exceed two heartbeats "
                             f"({2 * self.heartbeat_seconds}): one late write must not look like a death")
        return self


class WorkerKindSection(Section):
    """Where one kind of worker runs: how many, on which accelerators, spot or on-demand."""

    workers: int = Field(1, ge=0, description="long-lived workers of this kind (local processes or SkyPilot jobs)")
    accelerators: tuple[str, ...] = Field(min_length=1, description="SkyPilot any_of candidates, NAME:COUNT; the "
                                          "optimizer picks the cheapest offer on any enabled cloud")
    use_spot: bool = Field(True, description="spot (preemptible, recovered by SkyPilot) or on-demand")
    cpus: str | None = Field(None, description="SkyPilot cpus requirement, e.g. '8+' (null: the instance's)")
    memory: str | None = Field(None, description="SkyPilot memory requirement in GB, e.g. '32+'")
    disk_size: int = Field(100, ge=1, description="GB")
    local_cpus: list[int] | None = Field(None, description="embedded default: pin this kind's local worker "
                                         "processes to these CPUs")
    price_per_hour: float = Field(0.0, ge=0, description="what the cost ledger records per hour for a local "
                                  "worker of this kind (cloud workers: SkyPilot's record of the instance)")

    @field_validator("accelerators")
    @classmethod
    def _in_catalog(cls, specs: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(f"{name}:{count}" for name, count in map(catalog.parse_accelerator_spec, specs))

    @model_validator(mode="after")
    def _priced(self) -> "WorkerKindSection":
        """An accelerator the catalog cannot price would be billed $0 by the ledger: refuse it now."""
        for spec in self.accelerators:
            why = catalog.priceable(spec, self.use_spot)
            if why is not None:
                raise ValueError(f"accelerator {spec} cannot be priced: {why}")
        return self


#: SkyPilot's storage modes (``sky.data.storage.StorageMode``; tests/test_sky.py keeps the two equal)
MOUNT_MODES = ("MOUNT_CACHED", "MOUNT", "COPY")
#: URL schemes SkyPilot mounts as buckets (``sky.data.data_utils``: S3, GCS, R2, Azure Blob, IBM COS, OCI, Nebius)
BUCKET_SCHEMES = ("s3", "gs", "r2", "https", "cos", "oci", "nebius")


class MountSection(Section):
    """A bucket (or a folder in one) that every cloud worker sees at a local path: SkyPilot ``file_mounts``."""

    source: str = Field(description="bucket URL, e.g. s3://my-bucket/models/stable-diffusion-3.5-medium")
    mode: Literal[MOUNT_MODES] = Field("MOUNT_CACHED", description="SkyPilot's mode: MOUNT_CACHED (read "
                                       "through a local disk cache, the default for weights), MOUNT (streamed "
                                       "from the bucket), COPY (copied to the disk before the worker starts)")

    @field_validator("source")
    @classmethod
    def _bucket(cls, url: str) -> str:
        scheme, sep, rest = url.partition("://")
        if not sep or scheme not in BUCKET_SCHEMES or not rest.strip("/"):
            raise ValueError(f"{url!r} is not a bucket URL ({', '.join(s + '://' for s in BUCKET_SCHEMES)})")
        return url.rstrip("/")


DEFAULT_ACCELERATORS = {"trainer": ("A100:1", "A100-80GB:1", "H100:1", "L4:1", "A10G:1"),
                        "explorer": ("L4:1", "A10G:1", "A100:1", "H100:1")}


class PlacementSection(Section):
    """Where the run's work runs (not what it computes): may change between resumes of a run."""

    trainer: WorkerKindSection = WorkerKindSection(workers=1, accelerators=DEFAULT_ACCELERATORS["trainer"])
    explorer: WorkerKindSection = WorkerKindSection(workers=1, accelerators=DEFAULT_ACCELERATORS["explorer"])
    lease_seconds: float = Field(30.0, gt=0, description="a claimed work item's lease, renewed every third")
    stall_seconds: float = Field(120.0, gt=0, description="an exploration with no progress this long: the "
                                 "trainers join it (and the pool relaunches lost workers)")
    max_relaunches: int = Field(3, ge=0, description="per worker: relaunches after its job or process ended "
                                "while the run needed it, before the run fails naming it")
    idle_exit_seconds: float = Field(3600.0, gt=0, description="a cloud worker with no work this long exits "
                                     "(the controller is gone); the pool relaunches it when work comes")
    max_dollars: float | None = Field(None, gt=0, description="budget cap: no iteration starts whose forecast "
                                      "(the cost ledger so far plus the costliest iteration yet) would pass it; "
                                      "the run stops naming the cap, and a resume with a higher cap continues")
    flow_timeout_hours: float | None = Field(None, gt=0, description="a flow run that runs this long stops and "
                                             "tears its workers down (TimedOut); running it again resumes")
    sequence_parallel: SequenceParallelSection = Field(
        default_factory=SequenceParallelSection, description="elastic sequence-parallel groups for "
        "high-resolution rollouts (spotlight.sequence_parallel); degree 1: none")
    mounts: dict[str, MountSection] = Field({}, description="local path -> bucket (a URL, or {source, mode}): "
                                            "what cloud workers see as folders (model, prompts, reward weights; "
                                            "the config names the local paths). The run store is never mounted")
    cache: str | None = Field(None, description="bucket URL for the workers' Hugging Face and torch caches "
                              "(mounted MOUNT_CACHED at /spotlight-cache), so compiled kernels survive a "
                              "recovery to a new VM; null: the VM's own disk")

    @field_validator("mounts", mode="before")
    @classmethod
    def _mount_shorthand(cls, mounts: Any) -> Any:
        """``/models: s3://bucket/models`` means that bucket with the default mode."""
        if isinstance(mounts, dict):
            return {k: {"source": v} if isinstance(v, str) else v for k, v in mounts.items()}
        return mounts

    @field_validator("mounts")
    @classmethod
    def _mount_points(cls, mounts: dict[str, MountSection]) -> dict[str, MountSection]:
        out = {}
        for path, mount in mounts.items():
            clean = posixpath.normpath(path)
            if not clean.startswith("/") or clean == "/":
                raise ValueError(f"mount point {path!r}: expected an absolute folder path other than /")
            out[clean] = mount
        points = sorted(out)
        nested = [(a, b) for a in points for b in points if a != b and b.startswith(a + "/")]
        if nested:
            raise ValueError(f"mount point {nested[0][1]} lies inside mount point {nested[0][0]}; mount one bucket "
                             "folder per path")
        return out

    @field_validator("cache")
    @classmethod
    def _cache_bucket(cls, url: str | None) -> str | None:
        return None if url is None else MountSection(source=url).source

    @model_validator(mode="before")
    @classmethod
    def _kind_defaults(cls, data: Any) -> Any:
        """A kind given in part keeps its default accelerators."""
        if isinstance(data, dict):
            for kind, accelerators in DEFAULT_ACCELERATORS.items():
                if isinstance(data.get(kind), dict) and "accelerators" not in data[kind]:
                    data = {**data, kind: {**data[kind], "accelerators": accelerators}}
        return data

    @model_validator(mode="after")
    def _trainers(self) -> "PlacementSection":
        if self.trainer.workers < 1:
            raise ValueError(f"placement.trainer.workers is {self.trainer.workers}: a run needs at least one "
                             "trainer (it runs pretrain, update, evaluate and ranking)")
        return self


# Where these settings lived before placement had a section; committed configs of older runs (and
# older command lines) still use them, and are read as the placement they meant.
LEGACY_PLACEMENT = {("exploration", "workers"): ("explorer", "workers"),
                    ("exploration", "worker_cpus"): ("explorer", "local_cpus"),
                    ("exploration", "lease_seconds"): (None, "lease_seconds"),
                    ("exploration", "stall_seconds"): (None, "stall_seconds"),
                    ("run", "cpus"): ("trainer", "local_cpus")}


def move_legacy_placement(data: dict[str, Any]) -> dict[str, Any]:
    """A raw config with the old spellings of ``LEGACY_PLACEMENT`` moved to where placement keeps them."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
    placement = dict(data.get("placement") or {})
    for (section, key), (kind, new) in LEGACY_PLACEMENT.items():
        if isinstance(data.get(section), dict) and key in data[section]:
            value = data[section].pop(key)
            target = placement if kind is None else placement.setdefault(kind, {})
            if kind is not None:
                target = placement[kind] = dict(target)
            if new in target and target[new] != value:
                raise ConfigError(f"{section}.{key} (the old spelling) and placement.{kind + '.' if kind else ''}{new} "
                                  "are both set, differently; keep placement's")
            target[new] = value
    if placement:
        data["placement"] = placement
    return data

