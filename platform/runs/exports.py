"""Hugging Face exports of checkpoints, made by `python -m training.export` in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from django.conf import settings

from controlplane.processes import python_env
from runs.models import Checkpoint

# A CPU export of a model that fits one host takes seconds to a few minutes; past this the
# export is stuck and the caller sees an error instead of a worker held forever.
EXPORT_TIMEOUT_SECONDS = 1800


class ExportFailed(RuntimeError):
    pass


def export_folder(checkpoint: Checkpoint) -> Path:
    return checkpoint.run.run_dir.export(checkpoint.step)


def export(checkpoint: Checkpoint) -> Path:
    """Exports once; an export already committed (its config.json present) is reused."""
    out = export_folder(checkpoint)
    if checkpoint.export_path and (Path(checkpoint.export_path) / "config.json").exists():
        return Path(checkpoint.export_path)
    staging = checkpoint.run.run_dir.export_staging(checkpoint.step)
    result = subprocess.run(
        [settings.TRAINING_PYTHON, "-m", "training.export", checkpoint.path, str(staging)],
        cwd=settings.REPO_DIR, env=python_env(), capture_output=True, text=True, timeout=EXPORT_TIMEOUT_SECONDS,
    )
    if result.returncode != 0:
        raise ExportFailed(f"export of step {checkpoint.step} failed: {result.stderr.strip()[-2000:]}")
    # Renamed into place only when complete, so a crash mid-export never leaves a half model.
    if out.exists():
        shutil.rmtree(out)
    staging.replace(out)
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_path=str(out))
    return out
