"""Celery tasks for runs. Each is idempotent: it claims its row with a conditional UPDATE."""

from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.db.models import F
from django.utils import timezone

from runs import launcher, services
from runs.models import Run

log = logging.getLogger(__name__)


@shared_task
def launch_run(run_id: int) -> str:
    """Claims a queued run, prepares its folder and starts its agents, then returns."""
    claimed = Run.objects.filter(pk=run_id, status=Run.Status.QUEUED, cancel_requested=False).update(
        status=Run.Status.STARTING, launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now()
    )
    run = Run.objects.get(pk=run_id)
    if not claimed:
        # Redelivered after a worker died mid-launch: finish that launch unless agents run.
        if run.status != Run.Status.STARTING or any(launcher.is_alive(p) for p in run.agent_pids):
            return f"run {run_id} is {run.status}; nothing to do"
    folder, token = launcher.prepare(run)
    Run.objects.filter(pk=run_id).update(token_hash=services.hash_token(token))
    pids = launcher.start_agents(run, folder, token)
    Run.objects.filter(pk=run_id).update(agent_pids=pids)
    log.info("run %s: started agents %s", run_id, pids)
    return f"run {run_id} started agents {pids}"


@shared_task
def reconcile_runs() -> int:
    """Fails runs whose agents died or went silent; returns how many it failed."""
    silence = timedelta(seconds=settings.AGENT_SILENCE_TIMEOUT_SECONDS)
    failed = 0
    for run in Run.objects.filter(status__in=[Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING]):
        agents_alive = any(launcher.is_alive(pid) for pid in run.agent_pids)
        silent = run.last_report_at is None or timezone.now() - run.last_report_at > silence
        if agents_alive and not silent:
            continue
        if not agents_alive and run.agent_pids:
            reason = "every node agent exited without reporting an outcome"
        elif silent:
            reason = f"no report from the node agents for {int(silence.total_seconds())} s"
        else:
            continue
        if services.do_set_status(run, Run.Status.FAILED, reason, only_from=[run.status]):
            launcher.request_cancel(run)  # stop whatever is left, so no orphan keeps training
            failed += 1
    return failed
