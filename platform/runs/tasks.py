"""Celery tasks for runs. Each is idempotent: it claims its row with a conditional UPDATE."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any

from celery import shared_task
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane.queue import enqueue_on_commit
from hosts.tasks import schedule_and_start
from runs import executors, exports, launcher, quantized, services, slurm
from runs.models import Checkpoint, QuantizedExport, Run

log = logging.getLogger(__name__)

# How long a launch waits for the run's previous agents to exit (their cancel grace is 30 s).
AGENT_EXIT_WAIT_SECONDS = 60.0


@shared_task
def launch_run(run_id: int) -> str:
    """Claims a queued run and hands it to the executor (runs/executors.py), then returns.

    Local: claimed here and its agents started. Hosts: a scheduling pass claims it (with its
    devices) when it fits, and its agents start on its hosts. Slurm: claimed here and submitted
    as a job; the run stays queued, with Slurm's reason, until the job starts."""
    executor = executors.current()
    if executor is executors.SLURM:
        return _launch_on_slurm(run_id)
    if executor is executors.HOSTS:
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
        if run.status != Run.Status.STARTING or executor.state(run).alive:
            return f"run {run_id} is {run.status}; nothing to do"
        Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
    # A resumed run's previous agents may still be on their way out (they report `cancelled`
    # or `failed`, then flush and exit); their lock would turn the new agents away.
    deadline = time.monotonic() + AGENT_EXIT_WAIT_SECONDS
    while executor.state(run).alive and time.monotonic() < deadline:
        time.sleep(0.2)
    started = executor.submit(run)
    log.info("run %s: %s", run_id, started)
    return f"run {run_id} {started}"


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
    if run.status != Run.Status.STARTING or quiet_for <= LAUNCH_GRACE or executors.HOSTS.state(run).alive:
        return f"run {run_id} is {run.status}; nothing to do"
    if not run.device_claims.exists():
        return f"run {run_id} holds no devices; nothing to do"
    if run.cancel_requested:
        services.do_set_status(run, Run.Status.CANCELLED, "cancelled before its agents started", only_from=[run.status])
        return f"run {run_id} cancelled"
    Run.objects.filter(pk=run_id).update(launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())
    executors.HOSTS.submit(run)
    return f"run {run_id}: start tasks sent again"


# A launch that has not started an agent this long after its claim is sent again: its worker
# died (a broker without redelivery, such as the filesystem one, would otherwise lose it).
LAUNCH_GRACE = timedelta(seconds=20)


def _launch_on_slurm(run_id: int) -> str:
    """Submits the queued run as a Slurm job, once: the claim (a conditional UPDATE that puts
    SUBMITTING in its job id) admits one launch; one whose worker died after sbatch answered
    finds its job by name before it submits again."""
    run = Run.objects.get(pk=run_id)
    if run.status != Run.Status.QUEUED or run.cancel_requested:
        return f"run {run_id} is {run.status}; nothing to do"
    if run.slurm_job_id not in ("", slurm.SUBMITTING):
        return f"run {run_id} is Slurm job {run.slurm_job_id}; nothing to do"
    if run.slurm_job_id == slurm.SUBMITTING:
        if timezone.now() - (run.last_report_at or run.created_at) <= LAUNCH_GRACE:
            return f"run {run_id} is being submitted"
        try:
            if job_id := _adopt_submitted_job(run):
                return f"run {run_id}: found its Slurm job {job_id}"
        except slurm.SlurmError as exc:
            return f"run {run_id}: {exc}; its job may be queued, so it is not submitted again yet"
    claimed = Run.objects.filter(
        pk=run_id, status=Run.Status.QUEUED, cancel_requested=False,
        slurm_job_id=run.slurm_job_id, launch_attempts=run.launch_attempts,
    ).update(slurm_job_id=slurm.SUBMITTING, launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now())  # fmt: skip
    if not claimed:
        return f"run {run_id}: another launch claimed it"
    run.refresh_from_db()
    try:
        job_id = executors.SLURM.submit(run)
    except slurm.SlurmUnreachable as exc:
        # The job may or may not be in Slurm's queue: the next launch (reconcile re-sends it
        # after LAUNCH_GRACE) looks for it by name before it submits again.
        log.warning("run %s: %s; the launch will be sent again", run_id, exc)
        return f"run {run_id}: {exc}"
    except slurm.SlurmError as exc:
        Run.objects.filter(pk=run_id, slurm_job_id=slurm.SUBMITTING).update(slurm_job_id="")
        services.do_set_status(run, Run.Status.FAILED, f"Slurm refused the job: {exc}", only_from=[Run.Status.QUEUED])
        return f"run {run_id}: {exc}"
    _submitted(run, job_id)
    return f"run {run_id} is Slurm job {job_id}"


def _adopt_submitted_job(run: Run) -> str:
    """The job of the run's claimed launch, if sbatch took it before its worker died; "" if not.
    Raises slurm.SlurmError when squeue does not answer: then nobody knows."""
    name = slurm.job_name(run, run.launch_attempts)
    found = [job for job in slurm.jobs().values() if job.name == name and job.alive]
    if not found or not Run.objects.filter(pk=run.pk, slurm_job_id=slurm.SUBMITTING).update(slurm_job_id=found[0].id):
        return ""
    _submitted(run, found[0].id)
    return found[0].id


def _submitted(run: Run, job_id: str) -> None:
    run.refresh_from_db()
    if run.cancel_requested or run.status != Run.Status.QUEUED:
        slurm.cancel(job_id)  # cancelled while sbatch was answering: nothing started yet
        return
    services.do_note_waiting(run, f"waiting: submitted to Slurm as job {job_id}", slurm_job=job_id)


@shared_task
def reconcile_runs() -> int:
    """Re-sends lost launches; fails runs whose agents died or went silent. Returns failures."""
    now = timezone.now()
    silence = timedelta(seconds=settings.AGENT_SILENCE_TIMEOUT_SECONDS)
    executor = executors.current()
    if executor is not executors.HOSTS:
        # (On hosts, queued runs wait for room: beat's watch_hosts offers it to them every pass;
        # on Slurm, a run holding a job waits in Slurm's queue.)
        queued = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False, created_at__lt=now - LAUNCH_GRACE)
        for run in queued.filter(slurm_job_id__in=["", slurm.SUBMITTING]):
            launch_run.delay(run.pk)
    failed = 0
    # A run with a Slurm job is judged by what Slurm says of it (watch_slurm_jobs).
    active = Run.objects.filter(status__in=[Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING])
    for run in active.filter(slurm_job_id=""):
        if executor.state(run).alive:
            if executor is executors.HOSTS and run.status == Run.Status.STARTING:
                _start_what_hosts_lack(run, now)
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
            executor.cancel(run, started=True)  # stop whatever is left, so no orphan keeps training
            failed += 1
    return failed


def _start_what_hosts_lack(run: Run, now: datetime) -> None:
    """A placed run whose agents came up on some hosts and not on others (the broker lost a
    start task: a restart keeps nothing) would wait at its rendezvous until the join timeout
    fails it. Its start tasks go again, as the same launch with the same token: a host starts
    only what it does not run, and the agents already waiting stay in."""
    placed_at = run.events.filter(kind="placed").order_by("-seq").values_list("time", flat=True).first()
    if placed_at is None or now - placed_at <= LAUNCH_GRACE:
        return
    if missing := launcher.missing_on_hosts(run):
        log.warning("run %s: no host runs %s; its start tasks are sent again", run.pk, ", ".join(missing))
        executors.HOSTS.submit(run)


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
