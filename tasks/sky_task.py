"""The worker pool's SkyPilot tasks: the YAML of each worker kind under ``sky/``, with what the run's
placement decides for it, and what every task must declare.

Below both the launcher (``tasks/launcher.py``, which launches the tasks) and the planner
(``tasks/placement.py``, which checks and prices them), as ``sky/task.py`` sits below
``sky/optimizer.py`` and ``sky/jobs/``; neither of those imports the other.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import yaml

if TYPE_CHECKING:  # types only: planning (python -m tasks.placement) loads no config
    from spotlight.config import Config, WorkerKindSection
    from spotlight.config.placement import PlacementSection

SKY_DIR = Path(__file__).resolve().parent.parent / "sky"
WORKER_YAMLS = {"explorer": "explorer.yaml", "trainer": "trainer.yaml"}  # the task YAML of each worker kind

# Envs each task must declare (the launcher fills them); every task needs the run store.
REQUIRED_ENVS = {
    "spotlight-explorer": ("RUN_URL", "SPOTLIGHT_SLOT", "IDLE_EXIT"),
    "spotlight-trainer": ("RUN_URL", "SPOTLIGHT_SLOT", "IDLE_EXIT"),
    "spotlight-controller": ("RUN_URL", "CONFIG"),
}
# Secrets each task declares with no value (the launcher passes them; never inline in a YAML).
REQUIRED_SECRETS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
# placement.cache is mounted here; the Hugging Face and torch caches (compiled kernels) live in it.
CACHE_MOUNT = "/spotlight-cache"
CACHE_ENVS = {"HF_HOME": f"{CACHE_MOUNT}/huggingface", "TORCHINDUCTOR_CACHE_DIR": f"{CACHE_MOUNT}/torchinductor",
              "TRITON_CACHE_DIR": f"{CACHE_MOUNT}/triton"}


def placement_resources(template: Mapping[str, Any], kind: WorkerKindSection) -> dict[str, Any]:
    """A task YAML's ``resources`` with what placement says for the kind: accelerators (several become
    ``any_of``), spot or on-demand, cpus, memory, disk; the rest (``job_recovery``) is the YAML's."""
    out = {k: v for k, v in template.items()
           if k not in ("any_of", "ordered", "accelerators", "use_spot", "cpus", "memory", "disk_size")}
    out.update(use_spot=kind.use_spot, disk_size=kind.disk_size)
    if kind.cpus:
        out["cpus"] = kind.cpus
    if kind.memory:
        out["memory"] = kind.memory
    if len(kind.accelerators) == 1:
        out["accelerators"] = kind.accelerators[0]
    else:
        out["any_of"] = [{"accelerators": a} for a in kind.accelerators]
    return out


def placement_mounts(placement: PlacementSection) -> dict[str, dict[str, str]]:
    """SkyPilot ``file_mounts`` of every worker: ``placement.mounts`` (a model folder, a prompt set, reward
    weights: path -> bucket, mode), and ``placement.cache`` at CACHE_MOUNT (MOUNT_CACHED: written back to
    the bucket, so a recovered worker on a new VM finds the caches). The run store is not among them: it
    is read and written through S3's API (create-only commits need it), never through a FUSE mount."""
    mounts = {path: {"source": m.source, "mode": m.mode} for path, m in placement.mounts.items()}
    if placement.cache:
        mounts[CACHE_MOUNT] = {"source": placement.cache, "mode": "MOUNT_CACHED"}
    return mounts


def worker_task_config(kind: str, cfg: Config, sky_dir: Path = SKY_DIR) -> dict[str, Any]:
    """The worker YAML of a kind as a dict, with what the run's placement decides for it: its resources,
    its file mounts, and the cache locations when the caches are mounted."""
    raw = yaml.safe_load((Path(sky_dir) / WORKER_YAMLS[kind]).read_text())
    raw["resources"] = placement_resources(raw.get("resources") or {}, getattr(cfg.placement, kind))
    mounts = placement_mounts(cfg.placement)
    if mounts:
        raw["file_mounts"] = {**(raw.get("file_mounts") or {}), **mounts}
    if cfg.placement.cache:
        raw["envs"] = {**(raw.get("envs") or {}), **CACHE_ENVS}
    return raw
