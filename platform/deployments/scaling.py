"""What the control plane does with its autoscaler's decisions (`deployments.autoscaling`): after
each sync's scrape, move a deployment's replica count, put an idle one to sleep, and wake a
sleeping one when a request arrives.

The count is committed before the executor acts on it: a device claimed for a replica past the
committed count is given back (`hosts.scheduling.release_ended_claims`), so placing first could
lose the new replica's claim to the reconcile tick.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import transaction
from django.db.models import Max

from controlplane.queue import enqueue_on_commit
from deployments import services, supervision
from deployments.autoscaling import Decision, Load, ScalerState, decide
from deployments.models import ApiKey, Deployment, Replica
from deployments.options import stored_options
from launch import supervisors

# The statuses in which the autoscaler moves a deployment: serving, none starting as a whole.
SCALED = (Deployment.Status.READY, Deployment.Status.DEGRADED)


def autoscale(deployment: Deployment, metrics: dict[str, Any]) -> Decision | None:
    """Feeds one scrape of the ready replicas' figures to the deployment's autoscaler and carries
    out what it decides; returns the decision, if any."""
    if deployment.autoscaling is None:
        return None
    with transaction.atomic():
        row = Deployment.objects.select_for_update().get(pk=deployment.pk)
        policy = row.autoscaling_policy
        if policy is None or row.status not in SCALED or row.replicas == 0:
            return None
        last_used = ApiKey.objects.filter(deployment=row).aggregate(last=Max("last_used_at"))["last"]
        load = Load.of(metrics, last_used.timestamp() if last_used is not None else None)
        state, decision = decide(
            policy, row.replicas, stored_options(row.options).max_num_seqs, load, ScalerState.from_dict(row.scaler),
            time.time(),
        )  # fmt: skip
        before = row.replicas
        changes: dict[str, Any] = {} if state == ScalerState.from_dict(row.scaler) else {"scaler": state.to_dict()}
        if decision is not None:
            changes["replicas"] = decision.replicas
        if changes:  # a steady load changes nothing: no write every sync
            Deployment.objects.filter(pk=row.pk).update(**changes)
        if decision is None:
            return None
        services.do_record(row, "scaled", {"from": before, "to": decision.replicas, "reason": decision.reason})
        if decision.replicas == 0:
            enqueue_on_commit("deployments.tasks.sleep_deployment", row.pk)
            return decision
        for index in range(before, decision.replicas):
            Replica.objects.update_or_create(
                deployment=row, index=index, defaults={"status": Replica.Status.STARTING, "url": "", "pid": None}
            )
    row.refresh_from_db()
    try:
        changed = supervision.resize(row)
    except supervisors.NotPlaced as exc:
        _undo(row, before, f"no host has room for another replica: {exc}")
        return None
    if not changed:
        _undo(row, before, "no supervisor could take the change now: none runs, or a replica to remove shares its "
              "host's supervisor with one to keep")
        return None
    if decision.replicas < before:  # the page lists the replicas it runs; events keep the rest
        Replica.objects.filter(deployment=row, index__gte=decision.replicas).delete()
    return decision


def _undo(deployment: Deployment, replicas: int, reason: str) -> None:
    Deployment.objects.filter(pk=deployment.pk).update(replicas=replicas)
    Replica.objects.filter(deployment=deployment, index__gte=replicas).delete()
    services.do_record(deployment, "scale_blocked", {"replicas": replicas, "reason": reason})


def sleep(deployment: Deployment) -> bool:
    """Stops the supervisors of a deployment its autoscaler scaled to zero and marks it asleep;
    False when a request woke it, or something else moved it, meanwhile."""
    if deployment.replicas != 0 or deployment.status not in SCALED:
        return False
    supervision.stop(deployment)
    supervision.sync(deployment)
    supervision.mark_stopped(deployment)
    Deployment.objects.filter(pk=deployment.pk).update(supervisor_pid=None)  # it exited, as it was asked
    return services.do_set_status(
        deployment, Deployment.Status.ASLEEP, only_from=SCALED, event="asleep",
        data={"reason": "scaled to zero: the next request wakes it"},
    )  # fmt: skip


def wake(deployment_id: int) -> bool:
    """Starts a sleeping deployment again on `max(min_replicas, 1)` replicas (a request arrived);
    False when it is not asleep (awake, waking, or still going to sleep)."""
    with transaction.atomic():
        row = Deployment.objects.select_for_update().filter(pk=deployment_id, status=Deployment.Status.ASLEEP).first()
        if row is None:
            return False
        policy = row.autoscaling_policy
        replicas = max(policy.min_replicas, 1) if policy is not None else 1
        # No supervisor_pid until its start names the new one: reconcile_deployments would take
        # the old one's exit for a failure (it did, in a clean clone's test_v1_served).
        Deployment.objects.filter(pk=row.pk).update(
            status=Deployment.Status.PENDING, replicas=replicas, scaler=ScalerState(changed_at=time.time()).to_dict(),
            supervisor_pid=None,
        )  # fmt: skip
        Replica.objects.filter(deployment=row, index__gte=replicas).delete()
        services.do_record(row, "waking", {"replicas": replicas, "reason": "a request arrived while it slept"})
        enqueue_on_commit("deployments.tasks.start_deployment", row.pk)
    return True
