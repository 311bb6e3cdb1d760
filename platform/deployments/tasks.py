"""Celery tasks for deployments. The serving supervisor owns the replicas' lifetime."""

from __future__ import annotations

from typing import Any

from celery import shared_task
from django.db import transaction

from controlplane.processes import is_alive
from deployments import quality, scaling, services, supervision
from deployments.models import Deployment
from hosts import scheduling
from hosts.models import Host
from launch import executors
from runs import exports, quantized
from runs import services as run_services
from runs.models import QuantizedExport
from serving.state import DeploymentDir

# Deployments whose supervisor should be running.
SUPERVISED = [Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED]


@shared_task
def start_deployment(deployment_id: int) -> str:
    deployment = Deployment.objects.select_related("quantized_export").get(pk=deployment_id)
    if deployment.quantized_export is not None and not quantized.is_ready(deployment.quantized_export):
        # quantized_export_finished starts it, or fails it with the quantizer's reason.
        return "waiting for its quantized export"
    if not services.do_set_status(
        deployment, Deployment.Status.STARTING, only_from=[Deployment.Status.PENDING], event=None
    ):
        return "already claimed"
    try:
        pid = supervision.start(deployment)
    except Exception as exc:  # an export or option failure ends this deployment, with the reason
        services.do_set_status(
            deployment, Deployment.Status.FAILED, only_from=Deployment.Status.values, reason=str(exc),
            event="failed", data={"reason": str(exc)},
        )  # fmt: skip
        raise
    if pid is None:
        return "supervisor sent to its host"
    Deployment.objects.filter(pk=deployment_id).update(supervisor_pid=pid)
    services.do_record(deployment, "supervisor_started", {"pid": pid})
    return f"supervisor {pid}"


@shared_task(bind=True, max_retries=30, default_retry_delay=2)
def sync_adapters(self: Any, deployment_id: int) -> str:
    """Brings a running deployment's replicas to its adapter rows: exports what is not exported
    yet, rewrites its supervisor's config and signals it (`serving.replica_adapters`), which
    loads and unloads them without a restart. A deployment not started yet gets them at its start."""
    deployment = Deployment.objects.get(pk=deployment_id)
    if deployment.status not in SUPERVISED:
        return f"{deployment.status}: its start reads the adapters"
    try:
        adapters = supervision.adapter_exports(deployment)
    except exports.ExportFailed as exc:
        services.do_record(deployment, "adapter_failed", {"reason": str(exc)})
        return str(exc)
    if not DeploymentDir(deployment.folder).config_file.exists():
        # Its start is under way: it may have read the rows before this change, so come back
        # once it has written its supervisor's config.
        raise self.retry()
    signalled = executors.for_deployment(deployment).change_adapters(deployment, adapters)
    return f"{len(adapters)} adapters; supervisor {'signalled' if signalled else 'not running'}"


@shared_task
def quantized_export_finished(quantized_id: int) -> int:
    """Starts the deployments that waited for a quantized export now ready, or fails them with
    the quantizer's reason; returns how many it moved."""
    row = QuantizedExport.objects.get(pk=quantized_id)
    waiting = Deployment.objects.filter(quantized_export=row, status=Deployment.Status.PENDING)
    if quantized.is_ready(row):
        for deployment in waiting:
            services.do_record(deployment, "quantized", {"quantized_export": row.pk, "scheme": row.scheme, "bytes": row.size_bytes})
            start_deployment.delay(deployment.pk)
        return len(waiting)
    if row.status != QuantizedExport.Status.FAILED:
        return 0  # queued again by a later deploy since: that attempt's end is what counts
    reason = f"its {row.scheme} export could not be made: {row.reason}"
    return sum(
        services.do_set_status(
            deployment, Deployment.Status.FAILED, only_from=[Deployment.Status.PENDING], reason=reason,
            event="failed", data={"reason": reason},
        )  # fmt: skip
        for deployment in waiting
    )


@shared_task
def measure_quality(quantized_id: int) -> str:
    """Measures a ready quantized export's top-1 agreement with its float export and both
    exports' held-out perplexity, stores them with the export and records `quality_measured` (or `quality_failed`, with why) in the run's history."""
    row = QuantizedExport.objects.select_related("checkpoint__run").get(pk=quantized_id)
    if not quantized.is_ready(row):
        return "not ready"
    run, facts = row.checkpoint.run, {"step": row.checkpoint.step, "scheme": row.scheme, "quantized_export": row.pk}
    try:
        measured = quality.measure(row)
    except (quality.QualityFailed, quantized.QuantizeFailed) as exc:
        run_services.do_record_event(run, "quality_failed", {**facts, "reason": str(exc)})
        return f"failed: {exc}"
    agreement = measured.agreement
    QuantizedExport.objects.filter(pk=row.pk).update(
        top1=agreement.top1, top1_positions=agreement.positions, perplexity=measured.perplexity,
        source_perplexity=measured.source_perplexity,
    )  # fmt: skip
    run_services.do_record_event(run, "quality_measured", {
        **facts, "top1": agreement.top1, "positions": agreement.positions, "perplexity": measured.perplexity,
        "source_perplexity": measured.source_perplexity,
    })  # fmt: skip
    return f"top-1 {agreement.agree}/{agreement.positions}; perplexity {measured.perplexity:.3f} vs {measured.source_perplexity:.3f}"


@shared_task
def stop_deployment(deployment_id: int) -> str:
    deployment = Deployment.objects.get(pk=deployment_id)
    supervision.stop(deployment)
    # The supervisor's last events and states (replicas stopped), then what its exit implies.
    supervision.sync(deployment)
    supervision.mark_stopped(deployment)
    services.do_set_status(
        deployment, Deployment.Status.STOPPED, only_from=[Deployment.Status.STOPPING], event="stopped"
    )
    return "stopped"


@shared_task
def reconcile_deployments() -> int:
    """Takes the replicas of lost hosts out of their deployments (which fail only when no replica
    is left), places them again where there is room, and fails active deployments whose
    supervisor process is gone; returns how many failed."""
    def fail(deployment: Deployment, reason: str) -> bool:
        return services.do_set_status(
            deployment, Deployment.Status.FAILED, only_from=[deployment.status], reason=reason,
            event="failed", data={"reason": reason},
        )  # fmt: skip

    failed = 0
    # A deployment on a host that was lost lost the replicas there; the others serve on.
    for deployment in Deployment.objects.filter(status__in=SUPERVISED, device_claims__host__status=Host.Status.LOST).distinct():
        failed += supervision.lose_hosts(deployment)
    for deployment in Deployment.objects.filter(status=Deployment.Status.DEGRADED).select_related("checkpoint"):
        supervision.place_missing(deployment)
    with transaction.atomic():  # the host rows locked, as placement locks them
        scheduling.release_ended_claims(list(Host.objects.select_for_update().order_by("pk")))
    # One scaled to zero is going to sleep: its supervisor exits before it is marked asleep.
    for deployment in Deployment.objects.filter(status__in=SUPERVISED, supervisor_pid__isnull=False).exclude(replicas=0):
        if deployment.supervisor_pid is not None and not is_alive(deployment.supervisor_pid):
            said = supervisor_last_words(deployment)
            failed += fail(deployment, f"the replica supervisor exited: {said}" if said else "the replica supervisor exited")
    return failed


def supervisor_last_words(deployment: Deployment) -> str:
    """What the supervisor said as it gave up (its `fathom: ` line: an export it could not
    download names the object and why), from its log; empty if it said nothing."""
    try:
        lines = DeploymentDir(deployment.folder).supervisor_log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    said = [line.split("fathom: ", 1)[1] for line in lines if line.startswith("fathom: ")]
    return said[-1] if said else ""


@shared_task
def sync_deployments() -> int:
    """Collects replica events, state and metrics of every live deployment; returns how many."""
    live = Deployment.objects.filter(status__in=[*SUPERVISED, Deployment.Status.STOPPING])
    for deployment in live:
        metrics = supervision.sync(deployment)
        if metrics is not None:
            scaling.autoscale(deployment, metrics)
    return len(live)


@shared_task
def sleep_deployment(deployment_id: int) -> str:
    """Stops the replicas of a deployment its autoscaler scaled to zero; a request wakes it."""
    asleep = scaling.sleep(Deployment.objects.get(pk=deployment_id))
    return "asleep" if asleep else "woken or moved meanwhile"
