"""int8 and int4 copies of a checkpoint's Hugging Face export, made by `python -m serving.quantize`
(llmcompressor, in the quantizer's own env) in a subprocess, as `runs.exports` makes the export.

A `QuantizedExport` row is asked for by a deploy (`deployments.services`), made by the
`runs.tasks.quantize_export` task and then reused by every later deploy of that checkpoint in
that scheme. Calibration documents come from the run's own data: its validation dataset where
it has one, else its training dataset (a `validation_fraction` split is a share of token
sequences that only the trainer draws, so the whole file stands in for it).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.processes import python_env
from controlplane.queue import enqueue_on_commit
from runs import exports
from runs.models import Checkpoint, QuantizedExport
from serving import export_store
from serving.quantize import SERVED_AS, SUMMARY_FILE
from serving.vllm import Quantization
from training.storage import local_root

# GPTQ on CPU over a model that fits one host takes minutes; past this the subprocess is stuck.
QUANTIZE_TIMEOUT_SECONDS = 3600
# The fields of serving.quantize's stage lines that a progress event carries (the rest, paths
# of this machine's folders, stay in the summary file).
_STAGE_FIELDS = ("stage", "samples", "tokens", "bytes", "source_bytes", "size_ratio", "seconds", "error")


class QuantizeFailed(RuntimeError):
    pass


def served_as(scheme: str) -> Quantization:
    """The `ReplicaOptions.quantization` a replica of a `scheme` export runs with."""
    return cast(Quantization, SERVED_AS[scheme])


def folder(quantized: QuantizedExport) -> Path:
    """`exports/step_<N>-int8/` beside the float export `exports/step_<N>/`."""
    source = quantized.checkpoint.run.run_dir.export(quantized.checkpoint.step)
    return source.with_name(f"{source.name}-{quantized.scheme}")


def is_ready(quantized: QuantizedExport) -> bool:
    return quantized.status == QuantizedExport.Status.READY and (Path(quantized.path) / SUMMARY_FILE).is_file()


def do_request(checkpoint: Checkpoint, scheme: str) -> tuple[QuantizedExport, bool]:
    """The checkpoint's `scheme` export row, queued for quantizing unless it is ready or on its
    way; returns it and whether this call queued it. A failed one is queued again (its reason
    stays until the new attempt ends), as is a ready one whose folder is gone."""
    with transaction.atomic():
        quantized, created = QuantizedExport.objects.get_or_create(checkpoint=checkpoint, scheme=scheme)
        if not created:
            if quantized.status in (QuantizedExport.Status.PENDING, QuantizedExport.Status.RUNNING) or is_ready(quantized):
                return quantized, False
            # Taken back from failed (or from a ready row whose folder is gone) by a conditional
            # UPDATE: two deploys asking at once queue it once.
            moved = QuantizedExport.objects.filter(pk=quantized.pk, status=quantized.status).update(
                status=QuantizedExport.Status.PENDING, path="", finished_at=None, top1=None, top1_positions=None,
                perplexity=None, source_perplexity=None,
            )  # the figures were the old export's
            quantized.refresh_from_db()
            if not moved:
                return quantized, False
        enqueue_on_commit("runs.tasks.quantize_export", quantized.pk)
    return quantized, True


def claim(quantized: QuantizedExport) -> bool:
    """pending → running; False if another worker took it (a message delivered twice)."""
    return bool(
        QuantizedExport.objects.filter(pk=quantized.pk, status=QuantizedExport.Status.PENDING).update(
            status=QuantizedExport.Status.RUNNING
        )
    )


def calibration_dataset(checkpoint: Checkpoint) -> Path:
    """The run's own data file to calibrate on: its validation dataset, else its training one."""
    data = checkpoint.run.spec.get("data", {})
    chosen = data.get("validation_dataset") or data.get("dataset")
    if not chosen:
        raise QuantizeFailed(
            "the run trained on the built-in demo corpus, which has no dataset file to calibrate on; "
            "quantize a run trained on one of your datasets"
        )
    if local_root(chosen) is None:
        raise QuantizeFailed(f"calibrating on a dataset on object storage ({chosen}) is not supported yet")
    if not Path(chosen).is_file():
        raise QuantizeFailed(f"the run's dataset {chosen} is gone")
    return Path(chosen)


def make(quantized: QuantizedExport, on_stage: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Exports the checkpoint if needed, quantizes the export into `folder(quantized)` and
    returns serving.quantize's summary; `on_stage` gets each stage line as it is printed."""
    checkpoint = quantized.checkpoint
    try:
        source = exports.export(checkpoint)
    except exports.ExportFailed as exc:
        raise QuantizeFailed(str(exc)) from None
    if export_store.is_remote(source):
        raise QuantizeFailed(f"quantizing an export on object storage ({source}) is not supported yet")
    calibration = calibration_dataset(checkpoint)
    out = folder(quantized)
    command = [
        settings.QUANTIZE_PYTHON, "-m", "serving.quantize", source, str(out), "--scheme", quantized.scheme,
        "--calibration", str(calibration), "--samples", str(settings.QUANTIZE_SAMPLES),
    ]  # fmt: skip
    stages: list[dict[str, Any]] = []
    with subprocess.Popen(
        command, cwd=settings.REPO_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Everything it loads is the local export: never wait on the Hugging Face Hub.
        env={**python_env(), "HF_HUB_OFFLINE": "1"},
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        # Stage lines are few and short; stderr (llmcompressor's progress bars) is read after the
        # exit. A pipe holds 64 KiB, more than those bars write for a small model, but a big model
        # could fill it, so it is drained by communicate() once stdout closes.
        for line in process.stdout:
            if line.startswith("{"):
                stage = json.loads(line)
                stages.append(stage)
                on_stage({k: stage[k] for k in _STAGE_FIELDS if k in stage})
        try:
            _, stderr = process.communicate(timeout=QUANTIZE_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            raise QuantizeFailed(f"quantizing step {checkpoint.step} to {quantized.scheme} took over {QUANTIZE_TIMEOUT_SECONDS} s") from None
    if process.returncode != 0 or not stages or stages[-1]["stage"] != "done":
        said = stages[-1].get("error") if stages and stages[-1]["stage"] == "failed" else stderr.strip()[-2000:]
        raise QuantizeFailed(f"quantizing step {checkpoint.step} to {quantized.scheme} failed: {said}")
    summary = stages[-1]
    QuantizedExport.objects.filter(pk=quantized.pk).update(
        status=QuantizedExport.Status.READY, reason="", path=str(out), size_bytes=summary["bytes"],
        source_size_bytes=summary["source_bytes"], calibration=str(calibration), samples=summary["samples"],
        finished_at=timezone.now(),
    )  # fmt: skip
    return summary


def do_fail(quantized: QuantizedExport, reason: str) -> None:
    QuantizedExport.objects.filter(pk=quantized.pk).update(
        status=QuantizedExport.Status.FAILED, reason=reason, finished_at=timezone.now()
    )
