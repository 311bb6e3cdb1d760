"""A deployment's replica options: checked against this host's serving device and the checkpoint.

The API checks what a user gives at create; the start task resolves it once the checkpoint is
exported (max_model_len from the model's context) and stores what the replicas run with.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from controlplane.exceptions import InvalidInput
from serving.vllm import CheckpointInfo, DeviceInfo, OptionError, ReplicaOptions, check_compatible


def device() -> DeviceInfo:
    return DeviceInfo.local_cpu() if settings.SERVING_DEVICE == "cpu" else DeviceInfo(kind="cuda")


def check_options(options: dict[str, Any], export_path: str = "") -> ReplicaOptions:
    """Replica options, checked against the device (and the checkpoint once it is exported).

    Without a max_model_len, a replica serves the checkpoint's whole context (capped at 1024 on
    CPU and 8192 elsewhere, vLLM's KV cache being sized for it)."""
    try:
        given = {"device": settings.SERVING_DEVICE, **options}
        checkpoint = CheckpointInfo.read(export_path) if export_path else None
        if "max_model_len" not in options and checkpoint is not None and checkpoint.max_position_embeddings:
            cap = 1024 if settings.SERVING_DEVICE == "cpu" else 8192
            given["max_model_len"] = min(checkpoint.max_position_embeddings, cap)
        checked = ReplicaOptions.from_dict(given)
        if checkpoint is not None:
            check_compatible(checked, checkpoint, device())
    except OptionError as exc:
        raise InvalidInput(f"options.{exc.field}", exc.message) from None
    except TypeError as exc:
        raise InvalidInput("options", str(exc)) from None
    return checked
