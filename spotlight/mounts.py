"""Inputs a cloud run reads through ``placement.mounts``: the local paths a config names (a model folder,
a prompt set, reward weights), the buckets behind them, and the controller's check of those buckets.

A cloud worker sees a bucket at a local path (SkyPilot ``file_mounts``), so the config keeps naming
local paths and the same config runs on a laptop and in the cloud. The controller has no mounts: it
checks what the workers will see by reading the buckets through fsspec, with the very checks a worker
runs on its local paths (:func:`spotlight.run.check_inputs`). It mirrors the few levels of each input
those checks look at into a temporary folder, downloading the small files they read (JSON configs,
prompt files) and standing in empty files for weights, and reports any problem with the bucket URL.
A worker checks its mounted paths again when it starts (fails naming the path).
"""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spotlight.config import ConfigError, config_from_dict
from spotlight.config.rewards import REWARDS

if TYPE_CHECKING:
    from spotlight.config import Config

#: files the input checks read (the rest are only checked to exist): downloaded whatever their size
READ_SUFFIXES = (".json", ".txt", ".jsonl")
SMALL_BYTES = 4 << 20  # any other file up to this size is downloaded too
DEPTH = 2  # model_index.json and component folders (1), transformer/config.json (2)


def input_paths(cfg: Config) -> dict[str, str]:
    """Every local path the run reads, by config key: the pipeline folder, the prompt files, the weights of
    the rewards it uses (every string field of their sections)."""
    paths: dict[str, str] = {}
    if getattr(cfg.model, "pretrained", None):
        paths["model.pretrained"] = cfg.model.pretrained
    if cfg.data.prompts != "digits":
        paths["data.prompts"] = cfg.data.prompts
    if cfg.data.eval_prompts is not None:
        paths["data.eval_prompts"] = cfg.data.eval_prompts
    for name in cfg.rewards.names():
        options = REWARDS[name].options if name in REWARDS else None
        section = getattr(cfg.rewards, options) if options else None
        for field, value in (section.model_dump() if section is not None else {}).items():
            if isinstance(value, str):
                paths[f"rewards.{options}.{field}"] = value
    return {key: str(Path(value).expanduser()) for key, value in paths.items()}


def bucket_url(cfg: Config, path: str) -> str | None:
    """The bucket URL a worker reads at ``path`` (under one of ``placement.mounts``), or None."""
    path = posixpath.normpath(path)
    for point, mount in cfg.placement.mounts.items():
        if path == point or path.startswith(point + "/"):
            return mount.source + path[len(point):]
    return None


def check_mounted_inputs(cfg: Config, storage_options: dict[str, Any] | None = None) -> None:
    """The controller's check of a cloud run's inputs: each must lie under a mount, and the bucket behind
    it must hold what the worker-side checks need; ConfigError naming the config key and the URL."""
    from spotlight.run import check_inputs

    paths = input_paths(cfg)
    off = {key: path for key, path in paths.items() if bucket_url(cfg, path) is None}
    if off:
        points = ", ".join(cfg.placement.mounts) or "none"
        raise ConfigError("cloud workers see only what placement.mounts maps (mount points: " + points + "); "
                          "these inputs are on this machine only:\n" + "\n".join(
                              f"  {key}: {path}" for key, path in off.items())
                          + "\nupload them to a bucket and add e.g. --set 'placement.mounts={/models: "
                            "s3://my-bucket/models}'")
    if not paths:
        return
    with tempfile.TemporaryDirectory(prefix="spotlight-mounts-") as tmp:
        data, urls = cfg.model_dump(mode="json"), {}
        for i, (key, path) in enumerate(sorted(paths.items())):
            url = bucket_url(cfg, path)
            local = Path(tmp) / str(i) / Path(path).name
            _mirror(url, local, key, storage_options)
            urls[str(local)] = url
            _set(data, key, str(local))
        try:
            check_inputs(config_from_dict(data, "the run's inputs, as the buckets hold them"))
        except ConfigError as e:
            message = str(e)
            for local, url in sorted(urls.items(), key=lambda kv: -len(kv[0])):
                message = message.replace(local, url)
            raise ConfigError(f"{message}\n(read from the buckets placement.mounts maps; the workers see them "
                              "at the config's paths)") from None


def _mirror(url: str, local: Path, key: str, storage_options: dict[str, Any] | None) -> None:
    """Copy what the input checks look at of ``url`` (a file, or a folder to DEPTH levels) to ``local``."""
    import fsspec

    from spotlight.store import s3_storage_options

    options = s3_storage_options(storage_options) if url.startswith("s3://") else dict(storage_options or {})
    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()  # s3fs caches listings per process: read the bucket as it is now
    try:
        info = fs.info(root)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {url} does not exist (nothing in the bucket under that key)") from None
    except OSError as e:
        raise ConfigError(f"{key}: {url} cannot be read: {e}") from None
    if info["type"] != "directory":
        _fetch(fs, root, info, local)
        return
    local.mkdir(parents=True)
    for path, entry in fs.find(root, maxdepth=DEPTH, withdirs=True, detail=True).items():
        target = local / posixpath.relpath(path, root)
        if entry["type"] == "directory":
            target.mkdir(parents=True, exist_ok=True)
        else:
            _fetch(fs, path, entry, target)


def _fetch(fs: Any, path: str, info: dict[str, Any], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.suffix in READ_SUFFIXES or (info.get("size") or 0) <= SMALL_BYTES:
        target.write_bytes(fs.cat_file(path))
    else:
        target.touch()  # weights: their presence is what is checked, not their bytes


def _set(data: dict[str, Any], key: str, value: str) -> None:
    *parents, last = key.split(".")
    for part in parents:
        data = data[part]
    data[last] = value
