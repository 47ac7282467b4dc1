"""The run store: everything a run produces, under one fsspec URL (``file://`` or ``s3://``).

A commit is a step-named folder: each attempt to commit writes its objects under a key of its own,
then a small JSON manifest, created last and create-only (``O_EXCL`` locally, ``If-None-Match: *`` on
S3), that names the key, sha256 and size of every object:

    iterations/0003/update/COMMIT.json                                          the commit point
    iterations/0003/update/attempt-20260312T101502Z-3f9c1e2a04b7/policy.safetensors   its objects
    iterations/0003/update/attempt-20260312T101544Z-9d0e7c55a1f2/...                  a losing attempt

The manifest is the only commit point, so a reader never sees half a checkpoint, a restarted stage
resumes from the last commit, and a second writer of the same step (a lease taken over from a live
holder, another GPU type's bf16 bytes) can never overwrite what the manifest names: it loses the
manifest race, gets the winner's commit back and deletes its own attempt. Attempts that never
committed (a writer killed mid-commit) are removed by ``RunStore.sweep``. Manifests written before
attempt keys (objects at ``<name>/<obj>``) stay readable. A commit can be fenced by a claim
(``spotlight.fencing``): it is refused once the claim is lost.

On S3 (and S3-compatible stores: R2, MinIO — endpoint from ``AWS_ENDPOINT_URL`` or
``storage_options={"endpoint_url": ...}``) credentials come from the standard AWS chain and are
never written anywhere; every request is retried with backoff on transient errors (connection
refused/reset, timeouts, 5xx, throttling) but never on a failed precondition, and s3fs's listing
cache is bypassed so another process's commits are seen at once.
"""

from __future__ import annotations

import calendar
import contextlib
import hashlib
import io
import json
import os
import logging
import re
import secrets
import shutil
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable, Iterator, TypeVar
from urllib.parse import urlsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from spotlight.fencing import FencingToken

MANIFEST = "COMMIT.json"
TOMBSTONE = "PRUNED.json"  # beside a manifest: objects removed from that commit on purpose, and why
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0, 8.0, 8.0)  # seconds between attempts: rides out a ~20 s outage
ATTEMPT = re.compile(r"attempt-(\d{8}T\d{6}Z)-[0-9a-f]{12}")  # no dots: never mistaken for a temp file
# An attempt that has not committed after ATTEMPT_TTL_S is swept; its writer refuses to commit past half
# of it, so a sweep never removes objects a live writer may still commit (worker clocks agree to far
# better than TTL/2: the work queue's leases already need that).
ATTEMPT_TTL_S = 6 * 3600.0
_log = logging.getLogger(__name__)
T = TypeVar("T")


class StoreError(RuntimeError):
    """A run-store problem that names the object involved."""


class CorruptObjectError(StoreError):
    """A committed object whose bytes no longer match the checksum in its manifest."""


class AlreadyExistsError(StoreError):
    """A create-only write lost the race: the object exists already."""


class UnreachableStoreError(StoreError):
    """Preflight: the run store cannot be reached, read or written; one line naming the URL and the cause."""


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
    """s3fs options: the endpoint override for S3-compatible stores, bounded timeouts, the request
    counter's session; no keys here."""
    options = dict(storage_options or {})
    endpoint = options.pop("endpoint_url", None) or os.environ.get("AWS_ENDPOINT_URL")
    client_kwargs = dict(options.pop("client_kwargs", {}))
    if endpoint:
        client_kwargs.setdefault("endpoint_url", endpoint)
    options["client_kwargs"] = client_kwargs
    # botocore retries once itself; the rest is with_retries's (logged, and the same for every call)
    options.setdefault("config_kwargs", {"connect_timeout": 5, "read_timeout": 60,
                                         "retries": {"total_max_attempts": 2, "mode": "standard"}})
    if "session" in options:
        count_requests(options["session"])
    else:
        options["session"] = _counted_session()
    return options


# -- S3 requests, counted as AWS bills them ----------------------------------------------------------
# Amazon S3 pricing, "Requests & data retrievals" (https://aws.amazon.com/s3/pricing/, S3 Standard,
# US East (N. Virginia)): "PUT, COPY, POST, LIST requests" $0.005 per 1,000; "GET, SELECT, and all
# other requests" $0.0004 per 1,000; "DELETE and CANCEL requests are free". Multi-object delete
# (DeleteObjects) is a POST and is counted in the PUT class; the store itself deletes one key at a time.
S3_PRICE_PER_1000 = {"put": 0.005, "get": 0.0004, "free": 0.0}


@dataclass(frozen=True)
class RequestCounts:
    """S3 requests this process sent, by billing class. Each HTTP attempt counts (botocore's and our
    retries included); ``unanswered`` is how many of them got no HTTP response (a refused connection,
    a timeout), which S3 may never have seen."""

    put: int = 0  # PUT, COPY, POST, LIST: PutObject (a create-only claim too), ListObjectsV2, CopyObject, ...
    get: int = 0  # GET, HEAD and all other: GetObject, HeadObject, HeadBucket, ...
    free: int = 0  # DELETE and CANCEL: DeleteObject, AbortMultipartUpload
    unanswered: int = 0

    def __sub__(self, other: "RequestCounts") -> "RequestCounts":
        return RequestCounts(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def __add__(self, other: "RequestCounts") -> "RequestCounts":
        return RequestCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def billed(self) -> int:
        return self.put + self.get

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def cost_usd(self, price_per_1000: dict[str, float] = S3_PRICE_PER_1000) -> float:
        return sum(getattr(self, k) * price / 1000 for k, price in price_per_1000.items())


def request_class(operation: str, method: str) -> str:
    """The billing class of one S3 API call: 'put' (PUT/COPY/POST/LIST), 'get' (GET/HEAD/other) or 'free'."""
    if method == "DELETE" or operation == "AbortMultipartUpload":
        return "free"
    if method in ("PUT", "POST") or operation.startswith("List"):
        return "put"
    return "get"


class _RequestCounter:
    """Per process (reset in a forked child), shared by every store and s3fs client of the process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"put": 0, "get": 0, "free": 0, "unanswered": 0}

    def add(self, kind: str) -> None:
        with self._lock:
            self._counts[kind] += 1

    def snapshot(self) -> RequestCounts:
        with self._lock:
            return RequestCounts(**self._counts)

    def reset(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self._counts, 0)


_COUNTER = _RequestCounter()
os.register_at_fork(after_in_child=_COUNTER.reset)
#: the counters of :func:`counting_requests` windows open in this thread (a context variable: s3fs runs
#: its requests on its own event loop, in tasks that copy the calling thread's context)
_OWN: ContextVar[tuple[_RequestCounter, ...]] = ContextVar("spotlight_own_requests", default=())
_SESSION: tuple[int, Any] | None = None  # (pid, aiobotocore session) whose clients s3fs creates


def _on_send(event_name: str, request: Any, **_: Any) -> None:
    """botocore's ``before-send`` hook: once per HTTP attempt, with the operation in the event name."""
    kind = request_class(event_name.rsplit(".", 1)[-1], request.method)
    for counter in (_COUNTER, *_OWN.get()):
        counter.add(kind)


def _on_response(response_dict: Any = None, **_: Any) -> None:
    if response_dict is None:  # the attempt raised before any HTTP response came back
        for counter in (_COUNTER, *_OWN.get()):
            counter.add("unanswered")


def count_requests(session: Any) -> None:
    """Count every request of the clients ``session`` creates (a botocore/aiobotocore session:
    clients copy its event handlers when they are created). Idempotent."""
    session.register("before-send.s3", _on_send, unique_id="spotlight-count-send")
    session.register("response-received.s3", _on_response, unique_id="spotlight-count-response")


def _counted_session() -> Any:
    """One aiobotocore session per process, with the counter registered: every s3fs client the run
    store creates (and re-creates) comes from it, so no request goes uncounted."""
    global _SESSION
    if _SESSION is None or _SESSION[0] != os.getpid():
        from aiobotocore.session import AioSession

        session = AioSession()
        count_requests(session)
        _SESSION = (os.getpid(), session)
    return _SESSION[1]


def request_counts() -> RequestCounts:
    """The S3 requests this process has sent so far (take two snapshots and subtract for a window)."""
    return _COUNTER.snapshot()


@contextmanager
def counting_requests() -> Iterator[Callable[[], RequestCounts]]:
    """Count the S3 requests this thread sends inside the block, and only those (another thread's work
    in the same process is not counted): yields a function that returns them so far."""
    counter = _RequestCounter()
    token = _OWN.set((*_OWN.get(), counter))
    try:
        yield counter.snapshot
    finally:
        _OWN.reset(token)


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

    def key(self, obj: str) -> str:
        """Where ``obj`` of this commit is stored (a store key): its attempt's key, or ``<name>/<obj>`` for a
        manifest written before attempt keys."""
        entry = self.manifest["objects"].get(obj)
        if entry is None:
            raise StoreError(f"{self.store.url}/{self.name}: no object {obj!r} in its commit")
        return f"{self.name}/{entry.get('key', obj)}"

    def read(self, obj: str) -> bytes:
        if obj not in self._cache:
            key = self.key(obj)
            entry = self.manifest["objects"][obj]
            small = entry["size"] <= getattr(self.store.fs, "default_block_size", 0)  # one GET, no HEAD first
            try:
                data = self.store.read_bytes(key, small=small)
            except StoreError:
                pruned = self.store.pruned(self.name)
                if obj in pruned.get("objects", []):
                    raise StoreError(f"{self.store.url}/{self.name}/{obj} was {pruned['reason']}") from None
                raise
            if sha256(data) != entry["sha256"] or len(data) != entry["size"]:
                raise CorruptObjectError(
                    f"corrupt object {self.store.url}/{self.name}/{obj} (stored at {key}): sha256 "
                    f"{sha256(data)[:12]}… ({len(data)} bytes) does not match its commit ({entry['sha256'][:12]}…, "
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

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None,
                 retry_delays: tuple[float, ...] = RETRY_DELAYS):
        self.url = url.rstrip("/")
        options = s3_storage_options(storage_options) if self.url.startswith(("s3://", "s3a://")) else \
            (storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.retry_delays = retry_delays
        self.fence: FencingToken | None = None  # checked before every commit of this store (see ``fenced``)

    def child(self, sub: str) -> "RunStore":
        store = self._view()
        store.url, store.root = f"{self.url}/{sub}", f"{self.root}/{sub}"
        return store

    def fenced(self, fence: FencingToken) -> "RunStore":
        """This store, with every commit fenced by ``fence`` (a stage runs inside the fence of its claim)."""
        store = self._view()
        store.fence = fence
        return store

    def _view(self) -> "RunStore":
        store = RunStore.__new__(RunStore)
        store.__dict__.update(self.__dict__)
        return store

    def requests(self) -> RequestCounts:
        """S3 requests sent by this process (all its stores share one counter; a local store sends none)."""
        return request_counts()

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        return with_retries(what, fn, self.retry_delays)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}"

    # -- raw objects -----------------------------------------------------------------------
    def exists(self, key: str) -> bool:
        """Whether the object ``key`` exists (an object, not a folder): one HEAD on S3, never a LIST,
        and never s3fs's listing cache (another process may have written it since)."""
        if self.is_local:
            return self.fs.isfile(self.path(key))
        bucket, obj, _ = self.fs.split_path(self.path(key))
        try:
            self._retry(f"exists {self.url}/{key}", lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=obj))
        except FileNotFoundError:
            return False
        return True

    def version(self, key: str) -> str | None:
        """A token that changes whenever the object is written again (its ETag on S3: one HEAD), or None
        if it does not exist: what a poller compares to learn, cheaply, that something changed."""
        if self.is_local:
            try:
                st = os.stat(self.path(key))  # every write is a new file (temp + rename): a new inode
            except FileNotFoundError:
                return None
            return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"
        bucket, obj, _ = self.fs.split_path(self.path(key))
        try:
            head = self._retry(f"version of {self.url}/{key}",
                               lambda: self.fs.call_s3("head_object", Bucket=bucket, Key=obj))
        except FileNotFoundError:
            return None
        return str(head["ETag"])

    def read_bytes(self, key: str, small: bool = False) -> bytes:
        """``small`` (the object is under s3fs's block size): one GET on S3, where s3fs otherwise sends a
        HEAD first to decide whether to split the read into concurrent ranges."""
        try:
            if self.is_local:
                with self.fs.open(self.path(key), "rb") as f:
                    return f.read()
            options = {"max_concurrency": 1} if small else {}
            return self._retry(f"read {self.url}/{key}", lambda: self.fs.cat_file(self.path(key), **options))
        except FileNotFoundError as e:
            raise StoreError(f"missing object {self.url}/{key}") from e

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write an object. Atomic locally (temp file + rename); a single PUT on S3."""
        path = self.path(key)
        if self.is_local:
            os.replace(_durable_temp(path, data), path)
        else:  # one PUT of the whole object: S3 never shows a partial object, and a retry is a clean redo
            self._retry(f"write {self.url}/{key}", lambda: self.fs.pipe_file(path, data))

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
            self._retry(f"create {self.url}/{key}", lambda: self.fs.pipe_file(path, data, mode="create"))
        except FileExistsError as e:
            raise AlreadyExistsError(f"{self.url}/{key} exists") from e
        except (OSError, ValueError) as e:
            if "PreconditionFailed" in repr(e) or "412" in repr(e):
                raise AlreadyExistsError(f"{self.url}/{key} exists") from e
            raise
        finally:
            self.fs.invalidate_cache(path)

    def delete(self, key: str) -> None:
        """Remove an object (a missing one is fine). On S3 one DeleteObject: free, and no listing first."""
        try:
            if self.is_local:
                self.fs.rm(self.path(key))
            else:
                self._retry(f"delete {self.url}/{key}", lambda: self.fs.rm_file(self.path(key)))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> list[str]:
        """Keys directly under ``prefix`` (names only), sorted; always a fresh listing, never s3fs's cache.
        On S3 one ListObjectsV2 per 1,000 names (s3fs's ``ls`` sends a second LIST when a prefix is empty)."""
        path = self.path(prefix)
        try:
            if self.is_local:
                entries = self.fs.ls(path, detail=False, refresh=True)
                return sorted(os.path.basename(e.rstrip("/")) for e in entries)
            return self._retry(f"list {self.url}/{prefix}", lambda: self._list_s3(path))
        except FileNotFoundError:
            return []

    def _list_s3(self, path: str) -> list[str]:
        bucket, key, _ = self.fs.split_path(path)
        start = f"{key.rstrip('/')}/" if key.strip("/") else ""
        names, page = [], {"NextContinuationToken": None}
        while "NextContinuationToken" in page:
            token = page["NextContinuationToken"]
            page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=start, Delimiter="/",
                                   **({"ContinuationToken": token} if token else {}))
            names += [o["Key"][len(start):] for o in page.get("Contents", [])]
            names += [p["Prefix"][len(start):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(n for n in names if n)

    def list_tree(self, prefix: str) -> dict[str, float]:
        """Every object under ``prefix`` at any depth, by its key relative to ``prefix``, with when it was last
        written (epoch seconds; S3's LastModified). On S3 one ListObjectsV2 per 1,000 keys, however deep."""
        path = self.path(prefix).rstrip("/")
        if self.is_local:
            out = {}
            for folder, _, files in os.walk(path):
                for name in files:
                    full = os.path.join(folder, name)
                    try:
                        out[os.path.relpath(full, path)] = os.stat(full).st_mtime
                    except FileNotFoundError:  # removed while walking
                        continue
            return out
        bucket, key, _ = self.fs.split_path(path)
        start = f"{key}/" if key else ""

        def pages() -> dict[str, float]:
            out, page = {}, {"NextContinuationToken": None}
            while "NextContinuationToken" in page:
                token = page["NextContinuationToken"]
                page = self.fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=start,
                                       **({"ContinuationToken": token} if token else {}))
                out.update({o["Key"][len(start):]: o["LastModified"].timestamp() for o in page.get("Contents", [])})
            return out

        return self._retry(f"list {self.url}/{prefix}", pages)

    # -- commits ---------------------------------------------------------------------------
    def is_committed(self, name: str) -> bool:
        return self.exists(f"{name}/{MANIFEST}")

    def commit(self, name: str, objects: dict[str, bytes], meta: dict[str, Any] | None = None,
               fence: FencingToken | None = None) -> Commit:
        """Write the objects under a new attempt's keys, then create the manifest that names them.

        Idempotent: an existing commit is returned as is, and so is the commit of a writer that won the
        manifest race (this attempt's objects are then deleted: they are never read). ``fence`` (default:
        the store's, see ``fenced``) is checked right before the manifest is created; if its claim is lost,
        this attempt is deleted, nothing is committed and the check's error (``LeaseLostError``) propagates."""
        fence = fence or self.fence
        if self.is_committed(name):
            return self.load(name)
        attempt, started = new_attempt(), time.monotonic()
        keys = {obj: f"{attempt}/{obj}" for obj in objects}
        manifest = {
            "name": name,
            "attempt": attempt,
            "objects": {obj: {"key": keys[obj], "sha256": sha256(d), "size": len(d)} for obj, d in objects.items()},
            "meta": meta or {},
        }
        try:
            for obj, data in objects.items():
                self.write_bytes(f"{name}/{keys[obj]}", data)
            if fence is not None:
                fence.check()
            if time.monotonic() - started > ATTEMPT_TTL_S / 2:
                raise StoreError(f"commit of {self.url}/{name} refused: its objects took {time.monotonic() - started:.0f} s "
                                 f"to write, past half the {ATTEMPT_TTL_S:.0f} s after which a sweep may remove them")
        except BaseException:
            self._discard(name, attempt, keys.values())
            raise
        # If the manifest create fails for any other reason, its outcome is unknown: the attempt stays
        # (a committed manifest may name it) and a later sweep decides.
        try:
            self.create_bytes(f"{name}/{MANIFEST}", json_bytes(manifest))
        except AlreadyExistsError:  # another writer committed first (or a retry met our own first PUT)
            winner = self.load(name)
            if winner.manifest.get("attempt") != attempt:
                self._discard(name, attempt, keys.values())
            return winner
        return Commit(self, name, json.loads(json_bytes(manifest)))

    def _discard(self, name: str, attempt: str, keys: Iterable[str]) -> None:
        """Delete an attempt that will never be committed; what a failure here leaves, ``sweep`` removes."""
        try:
            self._remove_attempt(name, attempt, [f"{name}/{k}" for k in keys])
        except Exception as e:  # noqa: BLE001 - never hide why the commit itself ended
            _log.warning("could not delete attempt %s/%s/%s (%s); a sweep removes it", self.url, name, attempt, e)

    def _remove_attempt(self, name: str, attempt: str, keys: list[str]) -> None:
        if self.is_local:  # the folder, temp files of in-flight writes included
            shutil.rmtree(self.path(f"{name}/{attempt}"), ignore_errors=True)
        else:  # one DELETE per key: free, where a multi-object delete is a billed POST
            for key in keys:
                self.delete(key)

    def sweep(self, prefix: str = "", older_than: float = ATTEMPT_TTL_S, now: float | None = None) -> list[str]:
        """Remove the attempt objects under ``prefix`` that no manifest references; returns their keys.

        An attempt of a committed name that its manifest does not name can never be committed (the
        manifest is create-only): removed at once. An attempt of a name not committed yet is removed
        only once older than ``older_than`` (its writer died mid-commit): before that a live writer may
        still commit it, and writers refuse to commit past ``ATTEMPT_TTL_S / 2``. Costs one recursive
        listing (one LIST per 1,000 keys) and one manifest read per committed name that has attempts."""
        now = time.time() if now is None else now
        base = self.path(prefix) if prefix else self.root
        if not self.is_local:
            self.fs.invalidate_cache(base)
        keys = [p[len(self.root) + 1:] for p in self._retry(f"list {self.url}/{prefix}", lambda: self.fs.find(base))]
        committed = {k[: -len(MANIFEST) - 1] for k in keys if k.endswith(f"/{MANIFEST}")}
        attempts: dict[tuple[str, str], list[str]] = {}
        for key in keys:
            parts = key.split("/")
            at = next((i for i, part in enumerate(parts) if ATTEMPT.fullmatch(part)), None)
            if at:
                attempts.setdefault(("/".join(parts[:at]), parts[at]), []).append(key)
        referenced: dict[str, set[str]] = {}
        removed = []
        for (name, attempt), found in sorted(attempts.items()):
            if name in committed:
                if name not in referenced:
                    entries = self.load(name).manifest["objects"].values()
                    referenced[name] = {e["key"].split("/", 1)[0] for e in entries if "key" in e}
                if attempt in referenced[name]:
                    continue
            elif now - attempt_started(attempt) <= older_than:
                continue
            self._remove_attempt(name, attempt, found)
            removed += found
        return removed

    def load(self, name: str) -> Commit:
        key = f"{name}/{MANIFEST}"
        try:
            manifest = json.loads(self.read_bytes(key, small=True))
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
        """A small JSON record (a manifest, a lease, a ledger entry): one GET on S3."""
        return json.loads(self.read_bytes(key, small=True))


def new_attempt() -> str:
    """A fresh attempt id: when it started (UTC, for the sweep) and 48 random bits (unique per writer)."""
    return f"attempt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(6)}"


def attempt_started(attempt: str) -> float:
    match = ATTEMPT.fullmatch(attempt)
    if match is None:
        raise StoreError(f"not an attempt id: {attempt!r}")
    return float(calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%SZ")))


# -- preflight ---------------------------------------------------------------------------------------
# One try, short timeouts: a wrong URL or missing credentials are not outages worth riding out.
PREFLIGHT_S3_OPTIONS = {"retries": 1, "config_kwargs": {"connect_timeout": 3, "read_timeout": 10,
                                                         "retries": {"total_max_attempts": 1, "mode": "standard"}}}


def preflight(url: str, storage_options: dict[str, Any] | None = None) -> None:
    """Check that the run store at ``url`` can be reached and written before anything starts: create a
    probe object (create-only, and a second create must fail: the store's claims need that), read it
    back, delete it. Leaves nothing behind. Raises UnreachableStoreError with one line that names the
    URL and the cause (missing bucket, no/rejected credentials, access denied, unreachable endpoint)."""
    is_s3 = url.startswith(("s3://", "s3a://"))
    options = {**PREFLIGHT_S3_OPTIONS, **(storage_options or {})} if is_s3 else storage_options
    step = "opening it"
    made: list[str] = []
    try:
        store = RunStore(url, options, retry_delays=())
        if store.is_local:
            made = _missing_parents(store.path("probe"))
        key, probe = f"preflight-{secrets.token_hex(6)}", f"spotlight preflight {os.getpid()}".encode()
        step = "writing a probe object"
        store.create_bytes(key, probe)
        try:
            step = "creating it again (a create-only write must then fail)"
            try:
                store.create_bytes(key, probe)
            except AlreadyExistsError:
                pass
            else:
                raise UnreachableStoreError(f"run store {url} does not honour create-only writes (If-None-Match: *); "
                                            "the work queue's claims and the commits need them")
            step = "reading it back"
            if store.read_bytes(key) != probe:
                raise UnreachableStoreError(f"run store {url} returned other bytes than were written to {key}")
        except BaseException:
            with contextlib.suppress(Exception):  # the first failure is the one to report
                store.delete(key)
            raise
        step = "deleting it"
        store.delete(key)
    except UnreachableStoreError:
        raise
    except Exception as e:  # noqa: BLE001 - every cause becomes one line below
        cause, code = _cause(e, url)
        raise UnreachableStoreError(f"run store {url} is not usable: {cause} ({code}, while {step})") from None
    finally:
        for folder in made:  # the folders the probe needed, deepest first, if still empty
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def _missing_parents(path: str) -> list[str]:
    """The folders above ``path`` that do not exist yet, deepest first."""
    missing, folder = [], os.path.dirname(path)
    while folder and not os.path.exists(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    return missing


def _cause(exc: BaseException, url: str) -> tuple[str, str]:
    """What went wrong in words, and the error's code or type, from the botocore error under s3fs's
    (botocore's messages name no credential values; nothing else of the environment is used)."""
    from botocore.exceptions import (ClientError, ConnectTimeoutError, EndpointConnectionError,
                                     NoCredentialsError, PartialCredentialsError, ReadTimeoutError)

    chain, e = [], exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    bucket = url.split("://", 1)[1].split("/", 1)[0]
    for e in chain:
        if isinstance(e, (NoCredentialsError, PartialCredentialsError)):
            return ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE, "
                    "or run with an instance role", type(e).__name__)
        if isinstance(e, (EndpointConnectionError, ConnectTimeoutError)):
            where = urlsplit(getattr(e, "kwargs", {}).get("endpoint_url", ""))
            return f"cannot connect to the endpoint {where.scheme}://{where.netloc}", type(e).__name__
        if isinstance(e, ReadTimeoutError):
            return "the endpoint did not answer in time", type(e).__name__
        if isinstance(e, ClientError):
            code = e.response.get("Error", {}).get("Code", "")
            known = {"NoSuchBucket": f"the bucket {bucket} does not exist",
                     "InvalidAccessKeyId": "the credentials were rejected: the access key id is not known",
                     "SignatureDoesNotMatch": "the credentials were rejected: the secret key does not match the key id",
                     "ExpiredToken": "the credentials were rejected: the session token has expired",
                     "InvalidToken": "the credentials were rejected: the session token is not valid",
                     "AccessDenied": "access denied: these credentials may not read, write and delete objects there",
                     "AllAccessDisabled": "access denied: all access to the bucket is disabled"}
            return known.get(code, e.response.get("Error", {}).get("Message", str(e))), code or type(e).__name__
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else "no message"), type(exc).__name__


def json_bytes(value: Any) -> bytes:
    return json.dumps(value, indent=1, sort_keys=True).encode()


def png_bytes(figure_or_image: Any) -> bytes:
    buf = io.BytesIO()
    figure_or_image.save(buf, format="PNG") if hasattr(figure_or_image, "getpixel") else \
        figure_or_image.savefig(buf, format="png", dpi=120, bbox_inches="tight")
    return buf.getvalue()
