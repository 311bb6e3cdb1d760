"""Celery tasks for runs. Each is idempotent: it claims its row with a conditional UPDATE."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.queue import enqueue_on_commit
from hosts.tasks import schedule_and_start
from launch import executors, run_agents, slurm
from launch.executors import LAUNCH_GRACE
from runs import exports, quantized, services
from runs.models import Checkpoint, QuantizedExport, Run

log = logging.getLogger(__name__)


class RunsSide:
    """The runs' side of a launch (`executors.RunsSide`): runs.services records what happens to
    a run; a placement pass (hosts.tasks) places and starts queued runs."""

    claim_launch = staticmethod(services.do_claim_launch)
    set_status = staticmethod(services.do_set_status)
    note_waiting = staticmethod(services.do_note_waiting)
    place_and_start = staticmethod(schedule_and_start)


RUNS_SIDE = RunsSide()


@shared_task
def launch_run(run_id: int) -> str:
    """Claims a queued run and hands it to the executor (launch/executors.py), then returns:
    local, claimed here and its agents started; hosts, a placement pass claims it (with its
    devices) when it fits and its agents start on its hosts; Slurm, claimed here and submitted
    as a job, the run queued with Slurm's reason until the job starts."""
    return executors.current().launch(run_id, RUNS_SIDE)


@shared_task
def reconcile_runs() -> int:
    """Re-sends lost launches; fails runs whose agents died or went silent. Returns failures."""
    now = timezone.now()
    silence = timedelta(seconds=settings.AGENT_SILENCE_TIMEOUT_SECONDS)
    executor = executors.current()
    queued = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False, created_at__lt=now - LAUNCH_GRACE)
    for run in executor.relaunchable(queued):
        launch_run.delay(run.pk)
    failed = 0
    # A run with a Slurm job is judged by what Slurm says of it (watch_slurm_jobs).
    active = Run.objects.filter(status__in=[Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING])
    for run in active.filter(slurm_job_id=""):
        if executor.state(run).alive:
            if run.status == Run.Status.STARTING:
                executor.follow_start(run, now)
            continue  # a live agent owns the run, however long its steps or checkpoints take
        quiet_for = now - (run.last_report_at or run.created_at)
        if run.status == Run.Status.STARTING and quiet_for <= LAUNCH_GRACE:
            continue  # its launch is still under way
        if run.status == Run.Status.STARTING and run.launch_attempts < 3:
            launch_run.delay(run.pk)
            continue
        if run_agents.has_local_agents(run):
            reason = "every node agent exited without reporting an outcome"
        elif quiet_for > silence:
            # Agents on other hosts can only be judged by their reports.
            reason = f"no report from the node agents for {int(silence.total_seconds())} s"
        else:
            continue
        if services.do_set_status(run, Run.Status.FAILED, reason, only_from=[run.status]):
            executor.cancel(run, started=True)  # stop whatever is left, so no orphan keeps training
            failed += 1
    return failed


@shared_task
def watch_slurm_jobs() -> int:
    """Slurm's word on the active runs' jobs (one squeue; sacct for those it no longer holds):
    a pending job's reason and position become the queued run's reason, a job that started
    moves its run to starting, and a job that ended or vanished while its run was still active
    ends the run with why. Returns how many runs it moved."""
    runs = list(Run.objects.filter(status__in=Run.ACTIVE).exclude(slurm_job_id=""))
    if not runs:
        return 0
    try:
        states = executors.SLURM.states(runs)
    except slurm.SlurmError as exc:
        log.warning("the Slurm jobs' states are unknown this pass: %s", exc)  # nothing is judged on no answer
        return 0
    moved = 0
    for run in runs:
        state = states[run.pk]
        if state.waiting:
            if run.slurm_job_id == slurm.SUBMITTING:
                continue
            if run.status == Run.Status.QUEUED:
                services.do_note_waiting(run, f"waiting: {state.waiting}", slurm_job=run.slurm_job_id)
            elif (reason := f"requeued by Slurm: {state.waiting}") != run.status_reason:
                # Slurm requeued the job (preemption, a node failure, the time limit): its agents
                # stopped (`stopped`; one may have begun a restart of ranks that Slurm's SIGTERM
                # reached first), and the job's next start resumes from the newest checkpoint.
                moved += services.do_set_status(run, Run.Status.RESTARTING, reason, only_from=[run.status])
        elif state.alive:
            if run.status == Run.Status.QUEUED:
                moved += services.do_set_status(run, Run.Status.STARTING, "", only_from=[Run.Status.QUEUED])
            elif run.cancel_requested and _cancel_grace_passed(run):
                try:
                    slurm.cancel(run.slurm_job_id)  # the grace task's backstop (a lost message)
                except slurm.SlurmError as exc:
                    log.warning("run %s: %s", run.pk, exc)
        else:
            # The agents deliver their last events before they exit, and the job ends after
            # them: a run still active here was left without an outcome (the time limit, a
            # scancel outside Fathom: its agents only reported `stopped`). The UPDATE is
            # conditional, so an outcome that landed since this pass read the run wins.
            if run.cancel_requested:
                status, reason = Run.Status.CANCELLED, f"{state.ended} after the cancel"
            elif state.lost:
                status, reason = Run.Status.FAILED, state.ended
            else:
                status, reason = Run.Status.FAILED, f"{state.ended} before the run finished"
            moved += services.do_set_status(run, status, reason, only_from=[run.status])
    return moved


def _cancel_grace_passed(run: Run) -> bool:
    asked = run.events.filter(kind="cancel_requested").order_by("-seq").values_list("time", flat=True).first()
    return asked is not None and timezone.now() - asked > timedelta(seconds=settings.SLURM_CANCEL_GRACE_SECONDS)


@shared_task
def end_slurm_job(run_id: int, job_id: str) -> str:
    """A cancel's grace is over: scancel the run's job if its agents have not ended it."""
    job = slurm.jobs().get(job_id)
    if job is None or not job.alive:
        return f"run {run_id}: Slurm job {job_id} had ended"
    slurm.cancel(job_id)
    return f"run {run_id}: Slurm job {job_id} cancelled after the grace"


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


@shared_task
def quantize_export(quantized_id: int) -> str:
    """Makes a checkpoint's int8/int4 export, recording each stage in the run's history
    (`quantizing`, then `quantized` or `quantize_failed` with the reason), then hands the
    deployments waiting for it to `deployments.tasks.quantized_export_finished`."""
    row = QuantizedExport.objects.select_related("checkpoint__run").get(pk=quantized_id)
    if not quantized.claim(row):
        return "already claimed"
    run, step, scheme = row.checkpoint.run, row.checkpoint.step, row.scheme

    def progress(stage: dict[str, Any]) -> None:
        if stage["stage"] not in ("done", "failed"):
            services.do_record_event(run, "quantizing", {"step": step, "scheme": scheme, "quantized_export": row.pk, **stage})

    try:
        summary = quantized.make(row, progress)
    except quantized.QuantizeFailed as exc:
        with transaction.atomic():
            quantized.do_fail(row, str(exc))
            services.do_record_event(
                run, "quantize_failed", {"step": step, "scheme": scheme, "quantized_export": row.pk, "reason": str(exc)}
            )
            enqueue_on_commit("deployments.tasks.quantized_export_finished", row.pk)
        return f"failed: {exc}"
    with transaction.atomic():
        services.do_record_event(run, "quantized", {
            "step": step, "scheme": scheme, "quantized_export": row.pk, "bytes": summary["bytes"],
            "source_bytes": summary["source_bytes"], "samples": summary["samples"], "seconds": summary["seconds"],
        })  # fmt: skip
        enqueue_on_commit("deployments.tasks.quantized_export_finished", row.pk)
        # After the waiting deployments are sent on: they need not wait for the measurement.
        enqueue_on_commit("deployments.tasks.measure_quality", row.pk)
    return f"{scheme}: {summary['bytes']} bytes"
