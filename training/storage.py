"""Fathom's storage URL: a local folder (`file://…`, the default) or object storage (`s3://bucket/prefix`).

Every object a run keeps on storage is named by the run folder contract (`training.run_dir`);
this module only turns a URL into an fsspec filesystem and a root, and says whether storage
answers. Endpoint and credentials are not Fathom settings: s3fs (through botocore) reads the
standard AWS variables itself (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`,
`AWS_DEFAULT_REGION`, or a profile), in every process that touches storage, so the control plane,
the agents and the ranks of a host all reach it the same way.

Datasets on object storage are content-addressed (`dataset_url`: the object's name holds its
sha256), so a host's cached copy (`fetch_dataset`) is checked against the name it was fetched by.

Torch-free: the control plane checks storage at submit through `check_storage`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec
from fsspec.spec import AbstractFileSystem

# An unreachable endpoint must fail a submit in seconds, not after botocore's default of 60 s
# connect timeout × 5 attempts; a running save keeps the defaults (and their retries).
_CHECK_TIMEOUT_S = 5
_CHECK_CLIENT_CONFIG = {"connect_timeout": _CHECK_TIMEOUT_S, "read_timeout": _CHECK_TIMEOUT_S, "retries": {"max_attempts": 1}}


class StorageError(Exception):
    """Storage refused or did not answer; the message names the URL and the reason."""


def local_root(url: str) -> Path | None:
    """The folder a `file://` URL (or a plain path) names; None for object storage."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else url)
    return None


def join(url: str, *parts: str) -> str:
    """`url` with path parts appended, '/'-separated whatever the storage."""
    return "/".join([url.rstrip("/"), *(p.strip("/") for p in parts)])


@dataclass(frozen=True)
class Storage:
    """A folder on some fsspec filesystem: `fs` and the root path within it (no protocol)."""

    url: str
    fs: AbstractFileSystem
    root: str

    @classmethod
    def open(cls, url: str, **options: Any) -> Storage:
        fs, root = fsspec.core.url_to_fs(url, **options)
        return cls(url=url, fs=fs, root=root.rstrip("/"))

    def path(self, *parts: str) -> str:
        """The filesystem path (as `fs` takes it) of `parts` under the root."""
        return join(self.root, *parts)

    def url_of(self, *parts: str) -> str:
        return join(self.url, *parts)


def check_storage(url: str) -> None:
    """Raises StorageError unless storage at `url` answers and takes a write: an object is put
    under the root and deleted, so bad credentials, a missing bucket, a read-only key and an
    unreachable endpoint are all found before a run depends on them."""
    if local_root(url) is not None:
        root = local_root(url)
        assert root is not None
        if not root.is_dir():
            raise StorageError(f"storage {url}: the folder {root} does not exist")
        return
    options: dict[str, Any] = {}
    if urlparse(url).scheme == "s3":
        options = {"config_kwargs": _CHECK_CLIENT_CONFIG, "skip_instance_cache": True}
    try:
        storage = Storage.open(url, **options)
        probe = storage.path(f".fathom-probe-{uuid.uuid4().hex}")
        storage.fs.pipe_file(probe, b"")
        storage.fs.rm_file(probe)
    except Exception as exc:  # s3fs and botocore raise many types; the message is what users need
        raise StorageError(f"storage {url} cannot be written: {failure_reason(exc)}") from exc


def failure_reason(exc: BaseException) -> str:
    """The storage's own words for a failure: s3fs wraps botocore's errors (bucket, credentials)."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return f"the bucket or prefix does not exist ({text})"
    if isinstance(exc, PermissionError):
        return f"access denied: the credentials are wrong or may not write there ({text})"
    if "Could not connect" in text or "Connect timeout" in text or "EndpointConnectionError" in type(exc).__name__:
        return f"the endpoint did not answer ({text})"
    return text


# Datasets are hashed and copied in pieces of this size: a large corpus never sits in memory.
_CHUNK_BYTES = 8 << 20


def dataset_url(storage: str, sha256: str, filename: str) -> str:
    """Where an uploaded dataset is kept on object storage: named by its content, so the name
    says what a downloaded copy must hash to, and one upload of the same bytes is one object."""
    return join(storage, "datasets", sha256, filename)


def dataset_sha256(url: str) -> str:
    """The checksum a dataset's URL (`dataset_url`) names."""
    return url.rstrip("/").split("/")[-2]


def fetch_dataset(url: str, cache_root: Path) -> Path:
    """This host's copy of the dataset at `url`, downloaded into `cache_root/datasets/<sha256>/`
    unless it is there already. Ranks of one host (of any run) call this at once: a lock per
    entry makes one of them download, into a temporary name renamed into place once its sha256
    matches, so no rank ever reads a partial or corrupt file. Raises StorageError naming the
    object and why."""
    sha256 = dataset_sha256(url)
    entry = cache_root / "datasets" / sha256
    target = entry / url.rstrip("/").split("/")[-1]
    entry.mkdir(parents=True, exist_ok=True)
    with (entry / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if target.is_file():
            return target
        fd, tmp_name = tempfile.mkstemp(dir=entry, prefix=".download-")
        digest = hashlib.sha256()
        try:
            storage = Storage.open(url)
            with storage.fs.open(storage.root, "rb") as src, os.fdopen(fd, "wb") as dst:
                while chunk := src.read(_CHUNK_BYTES):
                    digest.update(chunk)
                    dst.write(chunk)
                dst.flush()
                os.fsync(dst.fileno())
        except Exception as exc:  # s3fs and botocore raise many types; the object and reason are what matter
            os.unlink(tmp_name)
            raise StorageError(f"dataset object {url} could not be downloaded: {failure_reason(exc)}") from exc
        if digest.hexdigest() != sha256:
            os.unlink(tmp_name)
            raise StorageError(f"dataset object {url} is corrupt: its sha256 is {digest.hexdigest()}, its name says {sha256}")
        os.replace(tmp_name, target)
    return target
