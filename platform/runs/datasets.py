"""Datasets and pretrained models: a user's uploads (or server paths an operator allows), checked,
stored content-addressed and registered for runs to name.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from django.conf import settings

from controlplane.exceptions import InvalidInput
from runs.models import Dataset, PretrainedModel
from runs.specs import run_storage
from training.config import SpecError
from training.pretrained import check_folder
from training.storage import Storage, dataset_url, failure_reason, local_root


def _scan_dataset(path: Path, fmt: str) -> tuple[int, str]:
    """Counts records and hashes the file; a JSONL line that is not an object with text fails."""
    digest = hashlib.sha256()
    records = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            digest.update(raw)
            line = raw.strip()
            if not line:
                continue
            if fmt == Dataset.Format.JSONL:
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InvalidInput("file", f"line {number} is not valid JSON ({exc.msg})") from None
                if not isinstance(obj, dict) or not (isinstance(obj.get("text"), str) or isinstance(obj.get("messages"), list)):
                    raise InvalidInput("file", f'line {number} must be an object with a "text" string or a "messages" list')
            else:
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidInput("file", f"line {number} is not UTF-8 text") from None
            records += 1
    if records == 0:
        raise InvalidInput("file", "holds no text")
    return records, digest.hexdigest()


def dataset_format(filename: str) -> str:
    suffix = Path(filename).suffix.lower()
    if suffix in (".txt", ".text", ".md"):
        return Dataset.Format.TEXT
    if suffix in (".jsonl", ".ndjson"):
        return Dataset.Format.JSONL
    raise InvalidInput("file", f"must be a .txt or .jsonl file; got {Path(filename).name!r}")


def check_dataset_path(raw: str) -> Path:
    """A server file an administrator registers; relative paths are taken under the data dir."""
    path = Path(raw)
    if not path.is_absolute():
        path = settings.DATA_DIR / path
    path = path.resolve()
    if not path.is_file():
        raise InvalidInput("path", f"no file at {path}")
    return path


def do_create_dataset(
    owner: Any, name: str, *, upload: Any = None, path: str = "", by_administrator: bool = False
) -> Dataset:
    """Stores an uploaded file (or registers a server file, for administrators) after checking every line.

    Only an administrator (staff in the API, the operator at the server's CLI) may name a server
    path: any other user could otherwise read, through a run, a file of the server or another
    user's upload.
    """
    if (upload is None) == (not path):
        raise InvalidInput("file", "give either an uploaded file or (administrators only) a path on the server")
    if path and not by_administrator:
        raise InvalidInput("path", "only administrators may register a server file as a dataset; upload the file instead")
    if upload is not None:
        fmt = dataset_format(upload.name)
        if upload.size > settings.MAX_DATASET_BYTES:
            raise InvalidInput("file", f"is {upload.size} bytes; the limit is {settings.MAX_DATASET_BYTES}")
        folder = settings.DATASETS_DIR / secrets.token_hex(8)
        folder.mkdir(parents=True)
        target = folder / Path(upload.name).name
        with target.open("wb") as out:
            for chunk in upload.chunks():
                out.write(chunk)
        try:
            records, sha = _scan_dataset(target, fmt)
        except InvalidInput:
            target.unlink()
            folder.rmdir()
            raise
    else:
        target = check_dataset_path(path)
        fmt = dataset_format(target.name)
        records, sha = _scan_dataset(target, fmt)
    size = target.stat().st_size
    where = str(target)
    if run_storage() and local_root(run_storage()) is None:
        where = _store_dataset(target, sha, removes_local=upload is not None)
    return Dataset.objects.create(
        owner=owner, name=name or target.name, format=fmt, path=where, size_bytes=size, records=records, sha256=sha
    )


def _store_dataset(target: Path, sha: str, *, removes_local: bool) -> str:
    """Puts a checked dataset on object storage, named by its checksum, where every host's ranks
    read it; an upload's local copy is dropped (an administrator's server file stays)."""
    url = dataset_url(run_storage(), sha, target.name)
    try:
        stored = Storage.open(url)
        stored.fs.put_file(str(target), stored.root)
    except Exception as exc:  # s3fs and botocore raise many types; the object and reason are what users need
        raise InvalidInput("file", f"could not be stored at {url}: {failure_reason(exc)}") from None
    finally:
        if removes_local:
            shutil.rmtree(target.parent, ignore_errors=True)
    return url


# --- Pretrained models ------------------------------------------------------------------------

# The files of a Hugging Face Llama folder a run reads; an upload holds these and nothing else.
PRETRAINED_FILE_NAMES = re.compile(
    r"^(config\.json|generation_config\.json|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json"
    r"|chat_template\.jinja|model\.safetensors|model\.safetensors\.index\.json|model-\d{5}-of-\d{5}\.safetensors)$"
)


def do_register_pretrained(
    owner: Any, name: str, *, uploads: list[Any] | None = None, path: str = "", by_administrator: bool = False
) -> PretrainedModel:
    """Stores an uploaded Hugging Face Llama folder (its files, flat), or registers a server
    folder (administrators only, as for datasets), once Fathom's decoder can compute its model."""
    if bool(uploads) == bool(path):
        raise InvalidInput("files", "give either the folder's files as uploads or (administrators only) a folder on the server")
    if path and not by_administrator:
        raise InvalidInput("path", "only administrators may register a server folder as a model; upload its files instead")
    field = "path" if path else "files"
    if uploads:
        names = [Path(upload.name).name for upload in uploads]
        wrong = [n for n in names if not PRETRAINED_FILE_NAMES.match(n)]
        if wrong:
            raise InvalidInput(
                "files",
                f"{wrong[0]} is not a file of a Hugging Face Llama folder; upload config.json, tokenizer.json (and its "
                "tokenizer_config.json, special_tokens_map.json, chat_template.jinja, generation_config.json) and "
                "model.safetensors or model.safetensors.index.json with its model-NNNNN-of-NNNNN.safetensors",
            )
        if len(set(names)) != len(names):
            raise InvalidInput("files", "holds one file name twice")
        size = sum(upload.size for upload in uploads)
        if size > settings.MAX_PRETRAINED_BYTES:
            raise InvalidInput("files", f"are {size} bytes together; the limit is {settings.MAX_PRETRAINED_BYTES}")
        folder = settings.PRETRAINED_DIR / secrets.token_hex(8)
        folder.mkdir(parents=True)
        for upload, file_name in zip(uploads, names, strict=True):
            with (folder / file_name).open("wb") as out:
                for chunk in upload.chunks():
                    out.write(chunk)
    else:
        folder = Path(path) if Path(path).is_absolute() else settings.DATA_DIR / path
        folder = folder.resolve()
        if not folder.is_dir():
            raise InvalidInput("path", f"no folder at {folder}")
    try:
        model = check_folder(folder)
    except SpecError as exc:
        if uploads:
            shutil.rmtree(folder, ignore_errors=True)
        raise InvalidInput(field, exc.message) from None
    size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    described = {k: v for k, v in dataclasses.asdict(model).items() if k != "seq_len"}
    # An upload's folder is named at random; a registered one was named by whoever put it there.
    default_name = f"llama-{model.n_layers}x{model.dim}" if uploads else folder.name
    return PretrainedModel.objects.create(
        owner=owner, name=name or default_name, path=str(folder), size_bytes=size, model=described
    )
