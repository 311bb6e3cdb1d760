"""Domain operations on deployments and their API keys."""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from django.db import transaction
from django.dispatch import Signal
from django.utils import timezone

from controlplane.events import publish_on_commit, reserve_seqs
from controlplane.exceptions import InvalidInput, WrongState
from controlplane.queue import enqueue_on_commit
from deployments.autoscaling import Autoscaling
from deployments.models import Adapter, ApiKey, Deployment, DeploymentEvent
from deployments.options import resolve_options
from launch import executors
from notifications.services import DEPLOYMENT_EVENTS, notify_on_commit
from runs import exports, quantized
from runs.models import Checkpoint, PretrainedModel, QuantizedExport
from serving.export_store import ExportStoreError
from serving.routing import DEFAULT_POLICY
from serving.state import replica_log
from training.checkpoint_storage import is_committed_at
from training.storage import local_root

_MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,199}$")


def check_served_model_name(name: str, field: str = "served_model_name") -> str:
    """A model name /v1 may serve: well formed, and neither an active deployment's nor an adapter's
    on one (a key's requests for another deployment's model are refused by that name)."""
    if not _MODEL_NAME.match(name):
        raise InvalidInput(field, "must start with a letter or digit and hold only letters, digits and . _ : / -")
    if Deployment.objects.filter(served_model_name=name, status__in=Deployment.ACTIVE).exists():
        raise InvalidInput(field, f"{name!r} is already served by another deployment")
    if Adapter.objects.filter(name=name, deployment__status__in=Deployment.ACTIVE).exists():
        raise InvalidInput(field, f"{name!r} is already served as an adapter")
    return name


def check_what_is_served(checkpoint: Checkpoint, merged: bool) -> None:
    """A LoRA run's checkpoint holds adapters, not a model: it is served merged into its base, or
    attached to a deployment of its base. `merged` asks for the first, and only such a one has it."""
    run = checkpoint.run
    if merged and not run.lora_rank:
        raise InvalidInput("merged", f"{run.name!r} is a full fine-tune: its checkpoint is a whole model already")
    if run.lora_rank and not merged:
        base = run.pretrained.name if run.pretrained else "its base"
        raise InvalidInput(
            "checkpoint",
            f"step {checkpoint.step} of {run.name!r} holds LoRA adapters, not a whole model: deploy it merged "
            f"into its base (merged: true), or deploy its base (the pretrained model {base!r}, with "
            "options.max_loras of 1 or more) and attach it there (POST /api/deployments/<id>/adapters/)",
        )


def check_checkpoint(checkpoint: Checkpoint) -> None:
    """A checkpoint can be deployed while its folder (or its prefix on object storage) is there
    or its export is."""
    try:
        if exports.is_exported(checkpoint):
            return
        on_object_storage = local_root(checkpoint.path) is None
        if checkpoint.pruned_at is None and (
            is_committed_at(checkpoint.path) if on_object_storage else Path(checkpoint.path).exists()
        ):
            return
    except (ExportStoreError, OSError) as exc:
        raise InvalidInput("checkpoint", f"step {checkpoint.step} cannot be read from storage: {exc}") from None
    kept = list(
        Checkpoint.objects.filter(run_id=checkpoint.run_id, pruned_at__isnull=True)
        .exclude(pk=checkpoint.pk)
        .values_list("step", flat=True)
    )
    raise InvalidInput(
        "checkpoint",
        f"the checkpoint of step {checkpoint.step} was deleted by the trainer (train.keep_checkpoints) and was never "
        f"exported; choose a kept one (steps {', '.join(map(str, kept)) or 'none'})",
    )


# The API's `quantization`: the checkpoint's own export, or an int8/int4 export Fathom makes
# from it (fp8 stays a replica option, `options.quantization`, which vLLM applies at load).
QUANTIZATION_CHOICES = ("none", *QuantizedExport.Scheme.values)


def check_quantization(quantization: str, options: dict[str, Any]) -> None:
    if quantization not in QUANTIZATION_CHOICES:
        raise InvalidInput("quantization", f"must be one of {', '.join(QUANTIZATION_CHOICES)}; got {quantization!r}")
    if quantization != "none" and options.get("quantization", "none") not in ("none", quantized.served_as(quantization)):
        raise InvalidInput(
            "quantization",
            f"{quantization!r} serves Fathom's {quantization} export, so options.quantization must be left out; "
            f"got options.quantization {options['quantization']!r}",
        )


def do_create_deployment(
    owner: Any,
    checkpoint: Checkpoint | None,
    *,
    name: str,
    served_model_name: str,
    replicas: int,
    options: dict[str, Any],
    quantization: str = "none",
    pretrained: PretrainedModel | None = None,
    merged: bool = False,
    routing: str = DEFAULT_POLICY,
    autoscaling: dict[str, Any] | None = None,
) -> Deployment:
    """Creates the deployment and queues its start. With `quantization` int8 or int4 it serves
    the checkpoint's quantized export: made first (queued here) when there is none yet, the
    deployment staying pending until `quantized_export_finished` starts it. With `pretrained`
    instead of a checkpoint it serves that model's folder as it is; `merged` serves a LoRA run's
    checkpoint merged into its base. `autoscaling` (deployments.autoscaling) lets its replica
    count follow its load from `replicas`."""
    autoscaling = checked_autoscaling(autoscaling, replicas)
    if pretrained is not None:
        if merged:
            raise InvalidInput("merged", "merges a LoRA run's checkpoint into its base; a pretrained model is whole")
        return _create_pretrained_deployment(
            owner, pretrained, name=name, served_model_name=served_model_name, replicas=replicas, options=options,
            quantization=quantization, routing=routing, autoscaling=autoscaling,
        )  # fmt: skip
    assert checkpoint is not None
    check_checkpoint(checkpoint)
    check_what_is_served(checkpoint, merged)
    if merged and quantization != "none":
        raise InvalidInput("quantization", "Fathom quantizes whole exports; a merged LoRA is served as it is (none)")
    check_quantization(quantization, options)
    served = check_served_model_name(
        served_model_name or f"{checkpoint.run.name}-step{checkpoint.step}".replace(" ", "-")
    )
    # Checked against what the quantized export will be before any row or task exists: a scheme
    # the device cannot run is refused without quantizing.
    planned = None
    if quantization != "none":
        planned = QuantizedExport.objects.filter(checkpoint=checkpoint, scheme=quantization).first() or QuantizedExport(
            checkpoint=checkpoint, scheme=quantization
        )
    resolved = resolve_options(options, checkpoint, planned)
    with transaction.atomic():
        quantized_export, queued = quantized.do_request(checkpoint, quantization) if planned else (None, False)
        deployment = Deployment.objects.create(
            owner=owner,
            name=name or served,
            checkpoint=checkpoint,
            merged=merged,
            quantized_export=quantized_export,
            served_model_name=served,
            replicas=replicas,
            routing=routing,
            autoscaling=autoscaling,
            options=resolved,
        )
        created = {"replicas": replicas, "checkpoint": checkpoint.pk, "quantization": quantization}
        do_record(deployment, "created", {**created, "merged": True} if merged else created)
        if quantized_export is not None and not quantized.is_ready(quantized_export):
            do_record(deployment, "waiting_for_quantization", {
                "quantized_export": quantized_export.pk, "scheme": quantization, "queued": queued,
            })  # fmt: skip
        # Started now if its export is ready; otherwise start_deployment leaves it pending (the
        # quantize task starts it), which also covers a quantization that finishes meanwhile.
        enqueue_on_commit("deployments.tasks.start_deployment", deployment.pk)
    return deployment


def _create_pretrained_deployment(
    owner: Any, pretrained: PretrainedModel, *, name: str, served_model_name: str, replicas: int,
    options: dict[str, Any], quantization: str, routing: str, autoscaling: dict[str, Any] | None,
) -> Deployment:  # fmt: skip
    if quantization != "none":
        raise InvalidInput(
            "quantization", "Fathom quantizes checkpoints' exports; a pretrained model is served as it is (none)"
        )
    served = check_served_model_name(served_model_name or pretrained.name.replace(" ", "-"))
    resolved = resolve_options(options, pretrained=pretrained)
    with transaction.atomic():
        deployment = Deployment.objects.create(
            owner=owner, name=name or served, pretrained=pretrained, served_model_name=served, replicas=replicas,
            options=resolved, routing=routing, autoscaling=autoscaling,
        )  # fmt: skip
        do_record(deployment, "created", {"replicas": replicas, "pretrained": pretrained.pk, "quantization": "none"})
        enqueue_on_commit("deployments.tasks.start_deployment", deployment.pk)
    return deployment


def checked_autoscaling(autoscaling: dict[str, Any] | None, replicas: int) -> dict[str, Any] | None:
    """The policy as stored, every field filled in; None keeps the count fixed."""
    if autoscaling is None:
        return None
    policy = Autoscaling.from_dict(autoscaling)
    policy.check_replicas(replicas)
    return policy.to_dict()


def do_set_autoscaling(deployment: Deployment, autoscaling: dict[str, Any] | None) -> Deployment:
    """Replaces an active deployment's autoscaling policy (None: its count stays where it is now).
    A count outside the new bounds moves to the nearest one at the next sync."""
    if deployment.status not in Deployment.ACTIVE:
        raise WrongState("status", f"autoscaling is set on active deployments; this one is {deployment.status}")
    stored = Autoscaling.from_dict(autoscaling).to_dict() if autoscaling is not None else None
    with transaction.atomic():
        Deployment.objects.filter(pk=deployment.pk).update(autoscaling=stored, scaler={})
        do_record(deployment, "autoscaling", {"autoscaling": stored})
    deployment.refresh_from_db()
    return deployment


def do_attach_adapter(deployment: Deployment, checkpoint: Checkpoint, name: str = "") -> Adapter:
    """Serves a LoRA run's checkpoint on `deployment`, which serves the run's base, as the model
    `name`; its running replicas load it without a restart (deployments.tasks.sync_adapters)."""
    if deployment.status not in Deployment.ACTIVE:
        raise WrongState("status", f"adapters are attached to active deployments; this one is {deployment.status}")
    run = checkpoint.run
    if not run.lora_rank:
        raise InvalidInput("checkpoint", f"step {checkpoint.step} of {run.name!r} is a full fine-tune's: it has no adapters")
    if deployment.pretrained_id is None or run.pretrained_id != deployment.pretrained_id:
        serves = f"the pretrained model {deployment.pretrained.name!r}" if deployment.pretrained else "a checkpoint"
        base = run.pretrained.name if run.pretrained else "?"
        raise InvalidInput(
            "checkpoint", f"{run.name!r} adapts the pretrained model {base!r}; this deployment serves {serves}"
        )
    max_loras, max_rank = deployment.options.get("max_loras", 0), deployment.options.get("max_lora_rank", 16)
    if not max_loras:
        raise InvalidInput(
            "options.max_loras",
            "is 0 on this deployment, whose replicas then run without LoRA: deploy the base with max_loras of 1 or more",
        )
    if run.lora_rank > max_rank:
        raise InvalidInput(
            "checkpoint",
            f"its adapters have rank {run.lora_rank}, more than this deployment's options.max_lora_rank ({max_rank})",
        )
    if not executors.for_deployment(deployment).change_adapters(deployment, None):
        raise InvalidInput(
            "deployment",
            "serves on hosts: adapters are attached, for now, to deployments whose replicas run on the control "
            "plane's machine",
        )
    check_checkpoint(checkpoint)
    name = name or f"{run.name}-step{checkpoint.step}".replace(" ", "-")
    if deployment.adapters.filter(name=name).exists():
        raise InvalidInput("name", f"{name!r} is already an adapter of this deployment")
    if name == deployment.served_model_name:
        raise InvalidInput("name", f"{name!r} is this deployment's own model")
    check_served_model_name(name, field="name")
    with transaction.atomic():
        adapter = Adapter.objects.create(deployment=deployment, name=name, checkpoint=checkpoint)
        do_record(deployment, "adapter_attached", {"name": name, "checkpoint": checkpoint.pk, "step": checkpoint.step})
        enqueue_on_commit("deployments.tasks.sync_adapters", deployment.pk)
    return adapter


def do_detach_adapter(adapter: Adapter) -> None:
    """Stops serving the adapter: its name answers 404 once the replicas have unloaded it."""
    deployment = adapter.deployment
    with transaction.atomic():
        adapter.delete()
        do_record(deployment, "adapter_detached", {"name": adapter.name})
        if deployment.status in Deployment.ACTIVE:
            enqueue_on_commit("deployments.tasks.sync_adapters", deployment.pk)


def do_stop_deployment(deployment: Deployment) -> Deployment:
    """Stops what runs of an active deployment, or of a failed one (a replica on a host that
    survived the failure). Its devices go back once the hosts no longer run it
    (`scheduling.release_ended_claims`)."""
    stoppable = [*Deployment.ACTIVE, Deployment.Status.FAILED]
    with transaction.atomic():
        if not do_set_status(deployment, Deployment.Status.STOPPING, only_from=stoppable, event="stopping"):
            raise WrongState(
                "status", f"only active or failed deployments can be stopped; this one is {deployment.status}"
            )
        enqueue_on_commit("deployments.tasks.stop_deployment", deployment.pk)
    return deployment


def do_set_status(
    deployment: Deployment,
    status: str,
    *,
    only_from: Iterable[str],
    reason: str | None = None,
    event: str | None = "status",
    data: dict[str, Any] | None = None,
) -> bool:
    """Moves the deployment to `status` if it is in one of `only_from`, and records `event` (with
    `data`) in the same transaction; False, and nothing recorded, if it had moved on. `reason`
    replaces `status_reason` when given; `event=None` records nothing (a task's claim)."""
    changes: dict[str, Any] = {"status": status}
    if reason is not None:
        changes["status_reason"] = reason
    with transaction.atomic():
        if not Deployment.objects.filter(pk=deployment.pk, status__in=list(only_from)).update(**changes):
            return False
        if event is not None:
            do_record(deployment, event, data or {})
        if status in DEPLOYMENT_EVENTS:
            notify_on_commit(deployment.owner_id, DEPLOYMENT_EVENTS[status], {"deployment": deployment.pk})
    deployment.refresh_from_db()
    return True


def do_issue_key(
    deployment: Deployment, name: str = "", rate_limit_per_minute: int | None = None
) -> tuple[ApiKey, str]:
    if deployment.status not in Deployment.ACTIVE:
        raise WrongState("status", f"keys are made for active deployments; this one is {deployment.status}")
    return ApiKey.issue(deployment, name, rate_limit_per_minute)


def do_change_key(key: ApiKey, **changes: Any) -> ApiKey:
    """Renames a key or changes its rate limit (`name`, `rate_limit_per_minute`)."""
    if not ApiKey.objects.filter(pk=key.pk, revoked=False).update(**changes):
        raise WrongState("revoked", "a revoked key cannot be changed")
    _forget_cached_key(key.pk)
    key.refresh_from_db()
    return key


def do_revoke_key(key: ApiKey) -> ApiKey:
    """Revokes a key for good. This process stops taking it at once, the others within the
    OpenAI endpoint's KEY_CACHE_S (they cache a checked key that long)."""
    if not ApiKey.objects.filter(pk=key.pk, revoked=False).update(revoked=True, revoked_at=timezone.now()):
        raise WrongState("revoked", f"this key was already revoked at {key.revoked_at:%Y-%m-%d %H:%M:%S} UTC")
    _forget_cached_key(key.pk)
    key.refresh_from_db()
    return key


# Sent with `key_id` once a change to that key commits: the OpenAI endpoint's key cache, which
# imports this module (not the other way round), drops its entry.
api_key_changed = Signal()


def _forget_cached_key(key_id: int) -> None:
    transaction.on_commit(lambda: api_key_changed.send(sender=ApiKey, key_id=key_id))


def do_record(deployment: Deployment, kind: str, data: dict[str, Any]) -> DeploymentEvent:
    """Appends an event to the deployment's history and publishes it after commit."""
    with transaction.atomic():
        seq = reserve_seqs(Deployment, deployment.pk, 1, last_report_at=timezone.now())
        event = DeploymentEvent.objects.create(deployment=deployment, seq=seq, kind=kind, time=timezone.now(), data=data)
        publish_on_commit(group(deployment.pk), [event.as_message()])
    return event


def log_tail(deployment: Deployment, replica: int, lines: int) -> list[str]:
    """The last `lines` of a replica's log, which its supervisor writes in the deployment folder."""
    path = replica_log(deployment.folder, replica)
    if not path.exists():
        return []
    with path.open("r", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=lines)]


def group(deployment_id: int) -> str:
    return f"deployment-{deployment_id}"
