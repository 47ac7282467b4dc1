"""The run store: everything a run produces, under one fsspec URL (``file://`` or ``s3://``).

Objects are immutable and step-named (``iterations/0003/update/policy.safetensors``). A commit is a
small JSON manifest, written last, that lists each object with its sha256; it is the only commit
point, so a reader never sees half a checkpoint and a restarted stage resumes from the last commit.
The manifest is written create-only (``O_EXCL`` locally, ``If-None-Match: *`` on S3), so two
writers racing on one step cannot both commit.

On S3 (and S3-compatible stores: R2, MinIO — endpoint from ``AWS_ENDPOINT_URL`` or
``storage_options={"endpoint_url": ...}``) credentials come from the standard AWS chain and are
never written anywhere; every request is retried with backoff on transient errors (connection
refused/reset, timeouts, 5xx, throttling) but never on a failed precondition, and s3fs's listing
cache is bypassed so another process's commits are seen at once.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

import fsspec
from fsspec.implementations.local import LocalFileSystem
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

MANIFEST = "COMMIT.json"
TOMBSTONE = "PRUNED.json"  # beside a manifest: objects removed from that commit on purpose, and why
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0)  # seconds between attempts: rides out a ~20 s outage
_log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreError(RuntimeError):
    """A run-store problem that names the object involved."""


class CorruptObjectError(StoreError):
    """A committed object whose bytes no longer match the checksum in its manifest."""


class AlreadyExistsError(StoreError):
    """A create-only write lost the race: the object exists already."""


_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
                    "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}
_TRANSIENT_TEXT = ("SlowDown", "reduce your request rate", "Throttl", "ServiceUnavailable", "InternalError",
                   "Connection refused", "Connection reset", "Could not connect", "Read timeout",
                   "Connect timeout", "Service Unavailable", "Internal Server Error", "Bad Gateway")


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying (the server was away or busy); never for a failed precondition."""
    if isinstance(exc, (FileExistsError, FileNotFoundError, PermissionError, StoreError)):
        return False
    if "PreconditionFailed" in repr(exc) or "412" in str(getattr(exc, "response", "")):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore ClientError
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError
        from botocore.exceptions import HTTPClientError
        if isinstance(exc, (BotoConnectionError, HTTPClientError)):
            return True
    except ImportError:  # pragma: no cover - botocore comes with s3fs
        pass
    text = str(exc)
    return any(t in text for t in _TRANSIENT_TEXT) or (exc.__cause__ is not None and is_transient(exc.__cause__))


def with_retries(what: str, fn: Callable[[], T], delays: tuple[float, ...] = RETRY_DELAYS) -> T:
    """Call ``fn``, retrying transient errors with backoff; other errors (and the last one) propagate."""
    for attempt, delay in enumerate((*delays, None)):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - classified just below
            if delay is None or not is_transient(e):
                raise
            _log.warning("%s: transient error (%s), retry %d in %.1fs", what, type(e).__name__, attempt + 1, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def s3_storage_options(storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """s3fs options: the endpoint override for S3-compatible stores, bounded timeouts; no keys here."""
    options = dict(storage_options or {})
    endpoint = options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(options.pop("client_kwargs", {}))
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    options["client_kwargs"] = client_kwargs
    # botocore retries once itself; the rest is with_retries's (logged, and the same for every call)
    options.setdefault("config_kwargs", {"connect_timeout": 5, "read_timeout": 60,
                                         "retries": {"total_max_attempts": 2, "mode": "standard"}})
    return options


def _durable_temp(path: str, data: bytes) -> str:
    """Write ``data`` to a fsynced temp file beside ``path`` (to be renamed or linked into place)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def bytes_to_tensors(data: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(data)


@dataclass
class Commit:
    """A committed step: its manifest, and its objects read on demand and checksum-verified."""

    store: "RunStore"
    name: str
    manifest: dict[str, Any]
    _cache: dict[str, bytes] = field(default_factory=dict)

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    def read(self, obj: str) -> bytes:
        if obj not in self._cache:
            entry = self.manifest["objects"].get(obj)
            if entry is None:
                raise StoreError(f"{self.store.url}/{self.name}: no object {obj!r} in its commit")
            key = f"{self.name}/{obj}"
            try:
                data = self.store.read_bytes(key)
            except StoreError:
                pruned = self.store.pruned(self.name)
                if obj in pruned.get("objects", []):
                    raise StoreError(f"{self.store.url}/{key} was {pruned['reason']}") from None
                raise
            if sha256(data) != entry["sha256"] or len(data) != entry["size"]:
                raise CorruptObjectError(
                    f"corrupt object {self.store.url}/{key}: sha256 {sha256(data)[:12]}… "
                    f"({len(data)} bytes) does not match its commit ({entry['sha256'][:12]}…, "
                    f"{entry['size']} bytes); nothing was changed in the store"
                )
            self._cache[obj] = data
        return self._cache[obj]

    def tensors(self, obj: str) -> dict[str, torch.Tensor]:
        return bytes_to_tensors(self.read(obj))

    def json(self, obj: str) -> Any:
        return json.loads(self.read(obj))


class RunStore:
    """One code path for local disk and S3 (any fsspec URL)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        self.url = url.rstrip("/")
        options = s3_storage_options(storage_options) if self.url.startswith(("s3://", "s3a://")) else \
            (storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def child(self, sub: str) -> "RunStore":
        store = RunStore.__new__(RunStore)
        store.url, store.fs, store.root, store.is_local = (
            f"{self.url}/{sub}", self.fs, f"{self.root}/{sub}", self.is_local)
        return store

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # -- raw objects -----------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        if self.is_local:
            return self.fs.exists(self.path(key))
        path = self.path(key)
        self.fs.invalidate_cache(path)  # another process may have written it since we last listed
        return with_retries(f"exists {self.url}/{key}", lambda: self.fs.exists(path))

    def read_bytes(self, key: str) -> bytes:
        try:
            if self.is_local:
                with self.fs.open(self.path(key), "rb") as f:
                    return f.read()
            return with_retries(f"read {self.url}/{key}", lambda: self.fs.cat_file(self.path(key)))
        except FileNotFoundError as e:
            raise StoreError(f"missing object {self.url}/{key}") from e

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write an object. Atomic locally (temp file + rename); a single PUT on S3."""
        path = self.path(key)
        if self.is_local:
            os.replace(_durable_temp(path, data), path)
        else:  # one PUT of the whole object: S3 never shows a partial object, and a retry is a clean redo
            with_retries(f"write {self.url}/{key}", lambda: self.fs.pipe_file(path, data))

    def create_bytes(self, key: str, data: bytes) -> None:
        """Create-only write: raises AlreadyExistsError if the object exists (the claim primitive)."""
        path = self.path(key)
        if self.is_local:
            tmp = _durable_temp(path, data)
            try:
                os.link(tmp, path)  # atomic and exclusive, like O_EXCL, but never exposes a partial file
            except FileExistsError as e:
                raise AlreadyExistsError(f"{self.url}/{key} exists") from e
            finally:
                os.unlink(tmp)
            return
        # If-None-Match: * . A retry after a lost response may see our own first PUT as "exists":
        # commit() treats that as committed (same bytes), a claim as lost (safe: the lease expires).
        try:
            with_retries(f"create {self.url}/{key}", lambda: self.fs.pipe_file(path, data, mode="create"))
        except FileExistsError as e:
            raise AlreadyExistsError(f"{self.url}/{key} exists") from e
        except (OSError, ValueError) as e:
            if "PreconditionFailed" in repr(e) or "412" in repr(e):
                raise AlreadyExistsError(f"{self.url}/{key} exists") from e
            raise
        finally:
            self.fs.invalidate_cache(path)

    def delete(self, key: str) -> None:
        try:
            if self.is_local:
                self.fs.rm(self.path(key))
            else:
                with_retries(f"delete {self.url}/{key}", lambda: self.fs.rm(self.path(key)))
                self.fs.invalidate_cache(self.path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (names only), sorted; always a fresh listing, never s3fs's cache."""
        path = self.path(prefix)
        try:
            entries = self.fs.ls(path, detail=False, refresh=True) if self.is_local else \
                with_retries(f"list {self.url}/{prefix}", lambda: self.fs.ls(path, detail=False, refresh=True))
        except FileNotFoundError:
            return []
        return sorted(os.path.basename(e.rstrip("/")) for e in entries)

    # -- commits ---------------------------------------------------------------------------
    def is_committed(self, name: str) -> bool:
        return self.exists(f"{name}/{MANIFEST}")

    def commit(self, name: str, objects: dict[str, bytes], meta: dict[str, Any] | None = None) -> Commit:
        """Write the objects, then the manifest last. Idempotent: an existing commit is returned as is."""
        if self.is_committed(name):
            return self.load(name)
        for obj, data in objects.items():
            self.write_bytes(f"{name}/{obj}", data)
        manifest = {
            "name": name,
            "objects": {obj: {"sha256": sha256(d), "size": len(d)} for obj, d in objects.items()},
            "meta": meta or {},
        }
        try:
            self.create_bytes(f"{name}/{MANIFEST}", json.dumps(manifest, indent=1, sort_keys=True).encode())
        except AlreadyExistsError:
            pass  # a concurrent writer committed the same deterministic step first
        return self.load(name)

    def load(self, name: str) -> Commit:
        key = f"{name}/{MANIFEST}"
        try:
            manifest = json.loads(self.read_bytes(key))
        except json.JSONDecodeError as e:
            raise CorruptObjectError(f"corrupt manifest {self.url}/{key}: {e}") from e
        return Commit(self, name, manifest)

    def tombstone(self, name: str, objects: list[str], reason: str) -> None:
        """Record that ``objects`` of commit ``name`` are removed on purpose (before removing them)."""
        previous = self.pruned(name).get("objects", [])
        self.put_json(f"{name}/{TOMBSTONE}", {"objects": sorted({*previous, *objects}), "reason": reason})

    def pruned(self, name: str) -> dict[str, Any]:
        """The tombstone of commit ``name`` ({} if nothing was pruned from it)."""
        key = f"{name}/{TOMBSTONE}"
        return self.get_json(key) if self.exists(key) else {}

    def put_json(self, key: str, value: Any) -> None:
        self.write_bytes(key, json.dumps(value, indent=1, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.read_bytes(key))


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True).encode()


def png_bytes(figure_or_image: Any) -> bytes:
    buf = io.BytesIO()
    figure_or_image.save(buf, format="PNG") if hasattr(figure_or_image, "getpixel") else \
        figure_or_image.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()
