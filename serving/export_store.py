"""Exports on object storage, and each serving host's cached copy of one.

An export kept on object storage is a prefix of objects (`training.run_dir.storage_export_url`):
the Hugging Face files, then, **last**, `fathom-export.json`, a manifest naming every file with
its size and sha256. Object storage has no rename, so the manifest is what makes an export count,
as a checkpoint's COMMITTED marker does: an upload killed half-way has none and is never served.

vLLM reads a local folder, so a supervisor downloads its deployment's export once per host
before any replica starts (`local_copy`): into `<cache>/exports/<manifest sha256>/`, keyed by
the manifest's own checksum so a re-made export is a new entry and a stale copy is never
served. Every file is checked against the manifest's sha256 as it is written into a temporary
folder of the cache, which is then renamed into place: two supervisors of one host (two
deployments of one export) each download whole and the first rename wins; neither sees half.

Torch-free and training-free (serving may not import training). Endpoint and credentials come
from the standard AWS variables, as for `training.storage`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import fsspec

MANIFEST = "fathom-export.json"
# Files are hashed and copied in pieces of this size: a multi-GB safetensors file never sits in memory.
_CHUNK_BYTES = 8 << 20


class ExportStoreError(Exception):
    """Storage refused an export's object, or it is not what its manifest says; the message names
    the object and the reason."""


def is_remote(location: str) -> bool:
    """Whether `location` (an export path as the control plane records it) is on object storage."""
    return urlparse(location).scheme not in ("", "file")


def _object(url: str, name: str) -> str:
    return f"{url.rstrip('/')}/{name}"


def _why(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, FileNotFoundError):
        return f"it does not exist ({text})"
    if isinstance(exc, PermissionError):
        return f"access denied: the credentials are wrong or may not read it ({text})"
    return text


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def upload(folder: Path, url: str) -> None:
    """Puts every file of the export `folder` under `url`, then its manifest: only then does the
    export count. Raises ExportStoreError naming the object that failed."""
    fs, root = fsspec.core.url_to_fs(url)
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        files[path.name] = {"size": path.stat().st_size, "sha256": _sha256_of(path)}
        try:
            fs.put_file(str(path), f"{root.rstrip('/')}/{path.name}")
        except Exception as exc:  # s3fs and botocore raise many types; the object and reason are what matter
            raise ExportStoreError(f"export object {_object(url, path.name)} could not be written: {_why(exc)}") from exc
    try:
        fs.pipe_file(f"{root.rstrip('/')}/{MANIFEST}", json.dumps({"files": files}, indent=2).encode())
    except Exception as exc:
        raise ExportStoreError(f"export object {_object(url, MANIFEST)} could not be written: {_why(exc)}") from exc


def read_manifest(url: str) -> tuple[dict[str, Any], str] | None:
    """The manifest of the export at `url` and its sha256; None while the export does not count."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        raw = fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        return None
    except Exception as exc:
        raise ExportStoreError(f"export object {_object(url, MANIFEST)} could not be read: {_why(exc)}") from exc
    return json.loads(raw), hashlib.sha256(raw).hexdigest()


def read_config(url: str) -> dict[str, Any]:
    """The export's config.json, read where it is (the control plane checks options against it)."""
    fs, root = fsspec.core.url_to_fs(url)
    try:
        return dict(json.loads(fs.cat_file(f"{root.rstrip('/')}/config.json")))
    except Exception as exc:
        raise ExportStoreError(f"export object {_object(url, 'config.json')} could not be read: {_why(exc)}") from exc


# What the control plane's endpoint needs of an export to count prompt tokens as vLLM will.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def fetch(url: str, cache_root: Path, *, tokenizer_only: bool = False) -> Path:
    """The local folder holding the export at `url` (or only its tokenizer files), downloaded
    into `cache_root` unless a checked copy of the same manifest is there already."""
    found = read_manifest(url)
    if found is None:
        raise ExportStoreError(f"export {url} cannot be served: it has no {MANIFEST} (never finished uploading)")
    manifest, key = found
    if tokenizer_only:
        manifest = {"files": {n: e for n, e in manifest["files"].items() if n in TOKENIZER_FILES}}
    entries = cache_root / ("tokenizers" if tokenizer_only else "exports")
    target = entries / key
    if (target / MANIFEST).is_file():
        return target
    entries.mkdir(parents=True, exist_ok=True)
    fs, root = fsspec.core.url_to_fs(url)
    staging = Path(tempfile.mkdtemp(prefix=f".{key[:16]}-", dir=entries))
    try:
        for name, expected in manifest["files"].items():
            _download_checked(fs, f"{root.rstrip('/')}/{name}", _object(url, name), staging / name, expected["sha256"])
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        try:
            os.rename(staging, target)
        except OSError:
            # Another supervisor of this host renamed its whole copy first (rename onto a
            # non-empty folder fails): use that one.
            if not (target / MANIFEST).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _download_checked(fs: Any, path: str, url: str, out: Path, sha256: str) -> None:
    digest = hashlib.sha256()
    try:
        with fs.open(path, "rb") as src, out.open("wb") as dst:
            while chunk := src.read(_CHUNK_BYTES):
                digest.update(chunk)
                dst.write(chunk)
    except Exception as exc:
        raise ExportStoreError(f"export object {url} could not be downloaded: {_why(exc)}") from exc
    if digest.hexdigest() != sha256:
        raise ExportStoreError(
            f"export object {url} is corrupt: its sha256 is {digest.hexdigest()}, the manifest says {sha256}"
        )


def local_copy(checkpoint: str, cache_root: Path, *, tokenizer_only: bool = False) -> str:
    """What a replica serves: `checkpoint` itself when local, else this host's cached copy."""
    if not is_remote(checkpoint):
        return checkpoint
    return str(fetch(checkpoint, cache_root, tokenizer_only=tokenizer_only))
