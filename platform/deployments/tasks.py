"""Celery tasks for deployments. The serving supervisor owns the replicas' lifetime."""

from __future__ import annotations

from celery import shared_task

from deployments import services
from deployments.models import Deployment
from runs.launcher import is_alive


@shared_task
def start_deployment(deployment_id: int) -> str:
    claimed = Deployment.objects.filter(pk=deployment_id, status=Deployment.Status.PENDING).update(
        status=Deployment.Status.STARTING
    )
    if not claimed:
        return "already claimed"
    deployment = Deployment.objects.get(pk=deployment_id)
    from deployments import supervision

    try:
        pid = supervision.start(deployment)
    except Exception as exc:  # an export or option failure ends this deployment, with the reason
        Deployment.objects.filter(pk=deployment_id).update(status=Deployment.Status.FAILED, status_reason=str(exc))
        services.do_record(deployment, "failed", {"reason": str(exc)})
        raise
    Deployment.objects.filter(pk=deployment_id).update(supervisor_pid=pid)
    services.do_record(deployment, "supervisor_started", {"pid": pid})
    return f"supervisor {pid}"


@shared_task
def stop_deployment(deployment_id: int) -> str:
    deployment = Deployment.objects.get(pk=deployment_id)
    from deployments import supervision

    supervision.stop(deployment)
    # The supervisor's last events and states (replicas stopped), then what its exit implies.
    supervision.sync(deployment)
    supervision.mark_stopped(deployment)
    Deployment.objects.filter(pk=deployment_id, status=Deployment.Status.STOPPING).update(status=Deployment.Status.STOPPED)
    services.do_record(deployment, "stopped", {})
    return "stopped"


@shared_task
def reconcile_deployments() -> int:
    """Fails active deployments whose supervisor process is gone; returns how many."""
    failed = 0
    for deployment in Deployment.objects.filter(
        status__in=[Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED],
        supervisor_pid__isnull=False,
    ):
        if deployment.supervisor_pid is not None and not is_alive(deployment.supervisor_pid):
            if Deployment.objects.filter(pk=deployment.pk, status=deployment.status).update(
                status=Deployment.Status.FAILED, status_reason="the replica supervisor exited"
            ):
                services.do_record(deployment, "failed", {"reason": "the replica supervisor exited"})
                failed += 1
    return failed


@shared_task
def sync_deployments() -> int:
    """Collects replica events, state and metrics of every live deployment; returns how many."""
    from deployments import supervision

    live = Deployment.objects.filter(
        status__in=[Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED, Deployment.Status.STOPPING]
    )
    for deployment in live:
        supervision.sync(deployment)
    return len(live)
