"""Hugging Face exports of checkpoints, made by `python -m training.export` in a subprocess.

A checkpoint on object storage is exported to object storage too (`serving.export_store`: the
files, then the manifest), so that serving hosts need no folder shared with the control plane;
each downloads it once into its own cache. Otherwise the export stays in the run folder.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from django.conf import settings

from controlplane.processes import python_env
from runs.models import Checkpoint
from serving import export_store
from training.run_dir import storage_export_url
from training.storage import local_root

# A CPU export of a model that fits one host takes seconds to a few minutes; past this the
# export is stuck and the caller sees an error instead of a worker held forever.
EXPORT_TIMEOUT_SECONDS = 1800


class ExportFailed(RuntimeError):
    pass


def export_folder(checkpoint: Checkpoint) -> Path:
    return checkpoint.run.run_dir.export(checkpoint.step)


def is_exported(checkpoint: Checkpoint) -> bool:
    """Whether the checkpoint's recorded export is whole where it is kept."""
    if not checkpoint.export_path:
        return False
    if export_store.is_remote(checkpoint.export_path):
        return export_store.read_manifest(checkpoint.export_path) is not None
    folder = Path(checkpoint.export_path)
    return (folder / "config.json").exists() or (folder / "adapter_config.json").exists()  # a model, or a LoRA's adapters


def export(checkpoint: Checkpoint) -> str:
    """Exports once and returns where the export is (a folder, or a URL on object storage); an
    export already whole is reused. A LoRA run's checkpoint exports as its PEFT adapter folder."""
    try:
        if is_exported(checkpoint):
            return checkpoint.export_path
    except export_store.ExportStoreError as exc:
        raise ExportFailed(str(exc)) from None
    staging = checkpoint.run.run_dir.export_staging(checkpoint.step)
    _run_export(checkpoint, staging)
    if local_root(checkpoint.path) is None:
        where = _upload(checkpoint, staging)
    else:
        # Renamed into place only when complete, so a crash mid-export never leaves a half model.
        out = export_folder(checkpoint)
        if out.exists():
            shutil.rmtree(out)
        staging.replace(out)
        where = str(out)
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_path=where)
    return where


def merged_folder(checkpoint: Checkpoint) -> Path:
    """Where a LoRA checkpoint's merged export is kept: beside its adapter export, in the run folder."""
    folder = export_folder(checkpoint)
    return folder.with_name(f"{folder.name}-merged")


def export_merged(checkpoint: Checkpoint) -> str:
    """A LoRA run's checkpoint as a whole model, its adapters merged into its base (made once,
    in the run folder: a deployment of it serves it as any export)."""
    out = merged_folder(checkpoint)
    if (out / "config.json").exists():
        return str(out)
    staging = out.with_name(f".{out.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    _run_export(checkpoint, staging, "--merged")
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)  # whole or not there: a crash mid-export leaves no half model
    return str(out)


def _run_export(checkpoint: Checkpoint, out: Path, *flags: str) -> None:
    result = subprocess.run(
        [settings.TRAINING_PYTHON, "-m", "training.export", checkpoint.path, str(out), *flags],
        cwd=settings.REPO_DIR, env=python_env(), capture_output=True, text=True, timeout=EXPORT_TIMEOUT_SECONDS,
    )  # fmt: skip
    if result.returncode != 0:
        raise ExportFailed(f"export of step {checkpoint.step} failed: {result.stderr.strip()[-2000:]}")


def _upload(checkpoint: Checkpoint, staging: Path) -> str:
    """Puts the export next to its checkpoint on object storage; the local copy is dropped."""
    storage = checkpoint.run.spec.get("data", {}).get("storage", "")
    url = storage_export_url(storage, checkpoint.run.folder.name, checkpoint.step)
    try:
        export_store.upload(staging, url)
    except export_store.ExportStoreError as exc:
        raise ExportFailed(f"export of step {checkpoint.step}: {exc}") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return url
