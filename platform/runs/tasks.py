"""Celery tasks for runs. Each is idempotent: it claims its row with a conditional UPDATE."""

from __future__ import annotations

import logging
import time
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from hosts import capacity
from hosts.tasks import schedule_and_start
from runs import exports, launcher, services
from runs.models import Checkpoint, Run

log = logging.getLogger(__name__)

# How long a launch waits for the run's previous agents to exit (their cancel grace is 30 s).
AGENT_EXIT_WAIT_SECONDS = 60.0


@shared_task
def launch_run(run_id: int) -> str:
    """Claims a queued run, prepares its folder and starts its agents, then returns.

    Once hosts have registered, the run is placed instead: a scheduling pass claims it (with
    its devices) when it fits, and its agents start on its hosts."""
    if capacity.cluster_exists():
        return _launch_on_hosts(run_id)
    claimed = Run.objects.filter(pk=run_id, status=Run.Status.QUEUED, cancel_requested=False).update(
        status=Run.Status.STARTING, launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now()
    )
    run = Run.objects.get(pk=run_id)
    if claimed:
        services.do_record_event(run, "status", {"status": Run.Status.STARTING, "reason": ""})
    else:
        # Redelivered (or re-sent by reconcile) after a worker died mid-launch: finish that
        # launch unless an agent runs. Agents take a per-node lock, so a race starts none twice.
        if run.status != Run.Status.STARTING or launcher.agents_alive(run):
            return f"run {run_id} is {run.status}; nothing to do"
        Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
    # A resumed run's previous agents may still be on their way out (they report `cancelled`
    # or `failed`, then flush and exit); their lock would turn the new agents away.
    deadline = time.monotonic() + AGENT_EXIT_WAIT_SECONDS
    while launcher.agents_alive(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    folder, token = launcher.prepare(run)
    Run.objects.filter(pk=run_id).update(token_hash=launcher.hash_token(token))
    pids = launcher.start_agents(run, folder, token)
    Run.objects.filter(pk=run_id).update(agent_pids=pids)
    log.info("run %s: started agents %s", run_id, pids)
    return f"run {run_id} started agents {pids}"


def _launch_on_hosts(run_id: int) -> str:
    placed = schedule_and_start()
    if run_id in placed:
        return f"run {run_id} placed and started"
    run = Run.objects.get(pk=run_id)
    if run.status == Run.Status.QUEUED:
        return f"run {run_id} {run.status_reason or 'waits'}"
    # Redelivered (or re-sent by reconcile): send the start tasks again if its agents never
    # came up. Not sooner than LAUNCH_GRACE after the last send: a new token would lock out
    # agents that are still starting.
    quiet_for = timezone.now() - (run.last_report_at or run.created_at)
    if run.status != Run.Status.STARTING or quiet_for <= LAUNCH_GRACE or launcher.agents_alive(run):
        return f"run {run_id} is {run.status}; nothing to do"
    if not run.device_claims.exists():
        return f"run {run_id} holds no devices; nothing to do"
    if run.cancel_requested:
        services.do_set_status(run, Run.Status.CANCELLED, "cancelled before its agents started", only_from=[run.status])
        return f"run {run_id} cancelled"
    Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
    launcher.start_on_hosts(run)
    return f"run {run_id}: start tasks sent again"


# A launch that has not started an agent this long after its claim is sent again: its worker
# died (a broker without redelivery, such as the filesystem one, would otherwise lose it).
LAUNCH_GRACE = timedelta(seconds=20)


@shared_task
def reconcile_runs() -> int:
    """Re-sends lost launches; fails runs whose agents died or went silent. Returns failures."""
    now = timezone.now()
    silence = timedelta(seconds=settings.AGENT_SILENCE_TIMEOUT_SECONDS)
    if not capacity.cluster_exists():
        # (On hosts, queued runs wait for room: beat's watch_hosts offers it to them every pass.)
        for run in Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False, created_at__lt=now - LAUNCH_GRACE):
            launch_run.delay(run.pk)
    failed = 0
    for run in Run.objects.filter(status__in=[Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING]):
        if launcher.agents_alive(run):
            continue  # a live agent owns the run, however long its steps or checkpoints take
        quiet_for = now - (run.last_report_at or run.created_at)
        if run.status == Run.Status.STARTING and quiet_for <= LAUNCH_GRACE:
            continue  # its launch is still under way
        if run.status == Run.Status.STARTING and run.launch_attempts < 3:
            launch_run.delay(run.pk)
            continue
        if launcher.has_local_agents(run):
            reason = "every node agent exited without reporting an outcome"
        elif quiet_for > silence:
            # Agents on other hosts can only be judged by their reports.
            reason = f"no report from the node agents for {int(silence.total_seconds())} s"
        else:
            continue
        if services.do_set_status(run, Run.Status.FAILED, reason, only_from=[run.status]):
            launcher.request_cancel(run)  # stop whatever is left, so no orphan keeps training
            failed += 1
    return failed


@shared_task
def watch_node_reports() -> int:
    """Marks node agents of active runs that stopped posting as silent; returns how many."""
    silent = 0
    for run in Run.objects.filter(status__in=Run.ACTIVE).exclude(node_reports={}):
        silent += len(services.do_mark_silent_nodes(run, settings.NODE_SILENT_SECONDS))
    return silent


@shared_task
def export_checkpoint(checkpoint_id: int) -> str:
    """Exports a checkpoint to Hugging Face format and records it in the run's history."""
    checkpoint = Checkpoint.objects.select_related("run").get(pk=checkpoint_id)
    try:
        path = exports.export(checkpoint)
    except exports.ExportFailed as exc:
        services.do_record_event(checkpoint.run, "export_failed", {"step": checkpoint.step, "reason": str(exc)})
        raise
    services.do_record_event(checkpoint.run, "exported", {"step": checkpoint.step, "path": str(path)})
    return str(path)
