"""A deployment's replica options: resolved and checked once, when the deployment is created.

The options are checked against this host's serving device and against the checkpoint's export:
the export itself when there is one, else the config.json its export will carry
(`training.hf_format`, from the run's model). Defaults are filled in (max_model_len from the
model's context) and the deployment stores the options resolved; the start task and the
replicas run with what is stored, and the page shows it. A pretrained model is served from its
own folder, whose config.json is read as an export's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from django.conf import settings

from controlplane.exceptions import InvalidInput
from hosts.models import Host
from hostworker.devices import cpu_flags
from launch import executors
from runs import exports, quantized
from runs.models import Checkpoint, PretrainedModel, QuantizedExport
from serving import export_store
from serving.vllm import CheckpointInfo, DeviceInfo, OptionError, ReplicaOptions, check_compatible, check_device
from training.config import ModelConfig
from training.hf_format import EXPORT_DTYPE, hf_config
from training.run_dir import CHECKPOINT_SPEC, CheckpointDir
from training.storage import Storage, local_root


def device() -> DeviceInfo:
    """This machine's device: where replicas run while no host has registered."""
    if settings.SERVING_DEVICE == "cpu":
        return DeviceInfo(kind="cpu", cpu_flags=frozenset(cpu_flags()))
    return DeviceInfo(kind="cuda")


def host_refusal(options: ReplicaOptions, host: Host) -> str | None:
    """Why replicas with these options cannot run on `host` (its CPU lacks a kernel they need),
    or None. Placement leaves such hosts out."""
    refusal = _refusal(options, host)
    return refusal.message if refusal else None


def _refusal(options: ReplicaOptions, host: Host) -> OptionError | None:
    try:
        check_device(options, host.serving_device())
    except OptionError as exc:
        return exc
    return None


def replica_device(options: ReplicaOptions) -> DeviceInfo:
    """The device a new deployment's options are checked against: this machine's while no host
    has registered; else a ready host's that can run them (placement takes only such hosts). When
    every ready host refuses, raises their reasons; with none ready, the device's facts are
    unknown and placement has the word at start."""
    hosts = executors.current().replica_hosts("gpu" if options.device == "cuda" else "cpu")
    if hosts is None:
        return device()
    refusals: dict[str, OptionError] = {}
    for host in hosts:
        refusal = _refusal(options, host)
        if refusal is None:
            return host.serving_device()
        refusals[host.name] = refusal
    if refusals:
        first = next(iter(refusals.values()))
        raise OptionError(
            first.field, "no ready host can run it: " + "; ".join(f"host {n}: {r.message}" for n, r in refusals.items())
        )
    return DeviceInfo(kind=options.device)


def export_info(checkpoint: Checkpoint) -> CheckpointInfo:
    """What the checkpoint's Hugging Face export says, or will say once the start task exports it."""
    try:
        if exports.is_exported(checkpoint):
            if export_store.is_remote(checkpoint.export_path):
                return CheckpointInfo.from_config(export_store.read_config(checkpoint.export_path), checkpoint.export_path)
            return CheckpointInfo.read(checkpoint.export_path)
    except export_store.ExportStoreError as exc:
        raise InvalidInput("checkpoint", f"step {checkpoint.step}: {exc}") from None
    # The model section of the spec saved in the checkpoint, which is what the export reads.
    where = checkpoint.path
    try:
        if local_root(where) is None:
            stored = Storage.open(where)
            where = stored.url_of(CHECKPOINT_SPEC)
            text = stored.fs.cat_file(stored.path(CHECKPOINT_SPEC)).decode()
        else:
            where = str(CheckpointDir(Path(where)).spec_file)
            text = Path(where).read_text()
        model = ModelConfig(**json.loads(text)["model"])
    except Exception as exc:  # a missing file, storage's many errors, or a spec without a model
        raise InvalidInput("checkpoint", f"step {checkpoint.step}: {where} does not say the model: {exc}") from None
    return CheckpointInfo.from_config(
        hf_config(model, EXPORT_DTYPE, bos=0, eos=0), checkpoint.run.run_dir.export(checkpoint.step)
    )


def quantized_info(row: QuantizedExport, source: CheckpointInfo) -> CheckpointInfo:
    """What the quantized export says, or will say once made: the float export's model with
    the weights of its scheme (serving.quantize writes a compressed-tensors config)."""
    if quantized.is_ready(row):
        return CheckpointInfo.read(row.path)
    return dataclasses.replace(
        source, path=quantized.folder(row), quant=quantized.served_as(row.scheme), quant_method="compressed-tensors"
    )


def resolve_options(
    options: dict[str, Any],
    checkpoint: Checkpoint | None = None,
    quantized_export: QuantizedExport | None = None,
    *,
    pretrained: PretrainedModel | None = None,
) -> dict[str, Any]:
    """The replica options a deployment of `checkpoint` (or of its `quantized_export`, or of a
    `pretrained` model's folder) stores: every default filled in, checked against the device and
    the export. Errors name the option (`options.max_model_len`); a quantized export sets
    `quantization` to what it is served as.

    Without a max_model_len, a replica serves the checkpoint's whole context (capped at 1024 on
    CPU and 8192 elsewhere, vLLM's KV cache being sized for it)."""
    try:
        if pretrained is not None:
            info = CheckpointInfo.read(pretrained.path)
        else:
            assert checkpoint is not None
            info = export_info(checkpoint)
        given = {"device": settings.SERVING_DEVICE, **options}
        if quantized_export is not None:
            info = quantized_info(quantized_export, info)
            given["quantization"] = quantized.served_as(quantized_export.scheme)
        if "max_model_len" not in options and info.max_position_embeddings:
            cap = 1024 if settings.SERVING_DEVICE == "cpu" else 8192
            given["max_model_len"] = min(info.max_position_embeddings, cap)
        checked = ReplicaOptions.from_dict(given)
        check_compatible(checked, info, replica_device(checked))
    except OptionError as exc:
        raise InvalidInput(f"options.{exc.field}", exc.message) from None
    except TypeError as exc:
        raise InvalidInput("options", str(exc)) from None
    return {k: v for k, v in checked.to_dict().items() if k != "device"}


def stored_options(stored: dict[str, Any]) -> ReplicaOptions:
    """The options a deployment stored at create (already resolved and checked), for its replicas."""
    return ReplicaOptions.from_dict({"device": settings.SERVING_DEVICE, **stored})
