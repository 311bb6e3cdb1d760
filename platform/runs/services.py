"""Domain operations on runs and their events. Views, consumers, tasks and the CLI call these;
a run's request is checked in `runs.specs`, datasets and pretrained models live in `runs.datasets`.

`check_*` validate and raise; `do_*` change state, record events and publish them after the
transaction commits, so a websocket never shows what the database does not hold.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from django.db import transaction
from django.db.models import F, Max, QuerySet
from django.utils import timezone

from controlplane import observability
from controlplane.events import publish_on_commit, reserve_seqs
from controlplane.exceptions import InvalidInput, WrongState
from controlplane.queue import enqueue_on_commit
from hosts import capacity, quotas
from hosts.models import Host
from launch import executors
from launch.slurm_options import SlurmOptions
from notifications.services import GUARD_EVENTS, RUN_EVENTS, notify_on_commit
from runs.models import Checkpoint, Dataset, PretrainedModel, Project, Run, RunEvent
from runs.specs import check_run_data, check_run_storage, run_storage
from training.checkpoint_storage import is_committed_at
from training.config import DataConfig, RunSpec
from training.planner.layout_costs import rank_memory
from training.storage import local_root

CONTROL_SOURCE = "control"

# --- Runs ------------------------------------------------------------------------------------


def resolve_data(
    spec: RunSpec,
    dataset: Dataset | None,
    tokenizer_run: Run | None,
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
) -> RunSpec:
    """The spec with the paths of the objects the run names, and only those: the dataset's file,
    the tokenizer the other run's ranks keep in its folder (or the pretrained folder's), the
    held-out dataset's file and the pretrained folder. Empty: the demo corpus, a tokenizer trained
    on the data, no second held-out file, a model initialised from the seed. The data section's
    other settings (the validation fraction) are the user's and stay."""
    tokenizer = str(tokenizer_run.tokenizer_dir) if tokenizer_run is not None else ""
    if pretrained is not None:
        tokenizer = str(Path(pretrained.path) / "tokenizer.json")
    data = DataConfig(
        dataset=dataset.path if dataset is not None else "",
        tokenizer=tokenizer,
        storage=run_storage(),
        validation_dataset=validation_dataset.path if validation_dataset is not None else "",
        validation_fraction=spec.data.validation_fraction,
        pretrained=pretrained.path if pretrained is not None else "",
    )
    return dataclasses.replace(spec, data=data)


def do_create_run(
    owner: Any,
    name: str,
    spec: RunSpec,
    dataset: Dataset | None,
    tokenizer_run: Run | None = None,
    *,
    priority: int = 0,
    validation_dataset: Dataset | None = None,
    pretrained: PretrainedModel | None = None,
    recipe: str = "",
    project: Project | None = None,
    slurm_options: SlurmOptions | None = None,
) -> Run:
    """Queues a run. The objects it names must be the owner's own: callers resolve ids among them.

    The spec is stored resolved, data paths included: from here to the ranks nobody parses or
    fills it in again (the launcher writes it as stored)."""
    check_run_data(spec, dataset, tokenizer_run, validation_dataset, pretrained)
    quotas.check_submit(owner, project, priority)
    rank_memory_mb = check_fits_cluster(spec)
    check_run_storage()
    resolved = resolve_data(spec, dataset, tokenizer_run, validation_dataset, pretrained)
    with transaction.atomic():
        run = Run.objects.create(
            owner=owner, name=name, spec=resolved.to_dict(), dataset=dataset, tokenizer_run=tokenizer_run,
            validation_dataset=validation_dataset, pretrained=pretrained, priority=priority, recipe=recipe,
            project=project, slurm=slurm_options.to_dict() if slurm_options is not None else {},
            rank_memory_mb=rank_memory_mb,
        )
        _record(run, "queued", {"status": Run.Status.QUEUED})
        enqueue_on_commit("runs.tasks.launch_run", run.pk)
    return run


def do_cancel_run(run: Run) -> Run:
    """Asks the run to stop. A queued run stops at once; a live one when its agent says so."""
    if not run.is_active:
        raise WrongState("status", f"only queued, starting, running or restarting runs can be cancelled; this one is {run.status}")
    with transaction.atomic():
        # Claim a queued run before its launch task does: whichever UPDATE matches wins.
        if Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED).update(
            status=Run.Status.CANCELLED, cancel_requested=True, finished_at=timezone.now()
        ):
            _record(run, "cancelled", {"status": Run.Status.CANCELLED, "reason": "cancelled before it started"})
            transaction.on_commit(lambda: _signal_cancel(run.pk, started=False))
        else:
            Run.objects.filter(pk=run.pk).update(cancel_requested=True)
            _record(run, "cancel_requested", {})
            transaction.on_commit(lambda: _signal_cancel(run.pk, started=True))
    run.refresh_from_db()
    return run


def _signal_cancel(run_id: int, *, started: bool) -> None:
    run = Run.objects.get(pk=run_id)
    executors.for_run(run).cancel(run, started=started)


def do_resume_run(run: Run) -> Run:
    """Queues a failed or cancelled run again; it continues from its latest checkpoint."""
    with transaction.atomic():
        claimed = Run.objects.filter(pk=run.pk, status__in=[Run.Status.FAILED, Run.Status.CANCELLED]).update(
            status=Run.Status.QUEUED, resume=True, cancel_requested=False, status_reason="", finished_at=None,
            slurm_job_id="",  # a new launch, a new job (the old one's id stays in the run's events)
        )
        if not claimed:
            raise WrongState("status", f"only failed or cancelled runs can be resumed; this one is {run.status}")
        _record(run, "queued", {"status": Run.Status.QUEUED, "resume": True})
        enqueue_on_commit("runs.tasks.launch_run", run.pk)
    run.refresh_from_db()
    return run


def do_set_status(run: Run, status: str, reason: str = "", *, only_from: Iterable[str] = Run.ACTIVE) -> bool:
    """Moves an active run to `status` and records it; False if the run had already moved on."""
    now = timezone.now()
    changes: dict[str, Any] = {"status": status, "status_reason": reason}
    if status in Run.FINISHED:
        changes["finished_at"] = now
    if status == Run.Status.RUNNING:
        changes["started_at"] = now
    with transaction.atomic():
        if not Run.objects.filter(pk=run.pk, status__in=list(only_from)).update(**changes):
            return False
        if status in Run.FINISHED:
            _release_devices(run)
        _record(run, "status", {"status": status, "reason": reason})
    run.refresh_from_db()
    return True


def do_claim_launch(run_id: int) -> bool:
    """Moves a queued run to `starting` for a launch on this machine, counting the launch, and
    records it; False if it was not queued (a launch delivered again)."""
    with transaction.atomic():
        claimed = Run.objects.filter(pk=run_id, status=Run.Status.QUEUED, cancel_requested=False).update(
            status=Run.Status.STARTING, launch_attempts=F("launch_attempts") + 1, last_report_at=timezone.now()
        )
        if claimed:
            _record(Run.objects.get(pk=run_id), "status", {"status": Run.Status.STARTING, "reason": ""})
    return bool(claimed)


def _requeue_stopped(run: Run, row: Mapping[str, Any], stopped: RunEvent) -> list[RunEvent]:
    """An agent said `stopped`: its ranks checkpointed the step they agreed on because a
    scheduler asked (a preemption). The run goes back to the queue and resumes from that step
    once placed again; its devices go back once its agents are gone."""
    step = stopped.data.get("step")
    by = row["preempted_by_id"]
    reason = (f"preempted by run {by}" if by else "stopped by the scheduler") + (
        f"; resumes from step {step}" if step is not None else ""
    )
    moved = Run.objects.filter(pk=run.pk, status__in=[s for s in Run.ACTIVE if s != Run.Status.QUEUED]).update(
        status=Run.Status.QUEUED, status_reason=reason, resume=True, preempted_by=None, reservation={},
    )
    if not moved:
        return []
    events = [
        _record(run, "preempted", {"by": by, "step": step, "reason": reason}, publish=False),
        _record(run, "queued", {"status": Run.Status.QUEUED, "resume": True, "reason": reason}, publish=False),
    ]
    enqueue_on_commit("hosts.tasks.schedule_runs")
    return events


def _release_devices(run: Run) -> None:
    """A run that ended gives back the devices nothing of it holds any more, and queued runs are
    offered them; the rest go back once their hosts' beats say its agents are gone."""
    if capacity.release([run.pk]):
        enqueue_on_commit("hosts.tasks.schedule_runs")


def check_fits_cluster(spec: RunSpec) -> dict[str, int]:
    """Refuses a run the registered hosts could never hold, even all free: too few devices of the
    kind it asks for, or none that holds one of its ranks (no hosts: the run starts on the
    worker's machine, as before hosts existed). Returns its busiest rank's memory, in MB, on a
    GPU and on a CPU slot, which placement checks hosts against."""
    memory = {kind: math.ceil(rank_memory(spec, device).total / 2**20) for kind, device in (("gpu", "h100"), ("cpu", "cpu"))}
    hosts = list(Host.objects.all())
    kinds = capacity.wanted_kinds(spec.to_dict(), any(h.device_kind == "gpu" for h in hosts))
    if reason := capacity.why_it_never_fits(capacity.need_of(spec.to_dict()), hosts, kinds):
        raise InvalidInput("spec.resources.device" if reason.startswith("asks for") else "spec.nodes", reason)
    if reason := capacity.why_memory_never_fits(memory, kinds, hosts):
        raise InvalidInput("spec.layout", reason)
    return memory


# --- Events ------------------------------------------------------------------------------------

# How an agent's event moves the run's status, and the statuses it may move the run from: a
# late `agent_started` from a second node must not send a running run back to starting, and
# finished runs never move.
_STATUS_BY_KIND = {
    "agent_started": Run.Status.STARTING,
    "metrics": Run.Status.RUNNING,
    "resumed": Run.Status.RUNNING,
    "restarting": Run.Status.RESTARTING,
    "succeeded": Run.Status.SUCCEEDED,
    "failed": Run.Status.FAILED,
    "cancelled": Run.Status.CANCELLED,
}
# Which statuses an agent's event may move a run from. A queued run has no agent of its own until
# one reports `agent_started` (a Slurm job that began before squeue said so, in the same batch).
_MOVES_FROM = {
    Run.Status.STARTING: [Run.Status.QUEUED],
    Run.Status.RUNNING: [Run.Status.STARTING, Run.Status.RESTARTING],
    Run.Status.RESTARTING: [Run.Status.STARTING, Run.Status.RUNNING],
    **{final: [Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING] for final in Run.FINISHED},
}


# What an agent's batch may hold (the API schema says the same: runs.serializers.IngestSerializer).
NODE_SOURCE = re.compile(r"node-([0-9]{1,6})")  # the sender: the node whose token the batch carries
MAX_BATCH_EVENTS = 10000
MAX_KIND_LENGTH = 32


def check_source(body: Any) -> int:
    """The node a batch names as its sender (`node-K`): its token must be that node's, so this
    is checked before the token, and the rest of the batch after."""
    if not isinstance(body, dict):
        raise InvalidInput("non_field_errors", 'must be an object {"source": ..., "events": [...]}')
    source = body.get("source")
    if source is None:
        raise InvalidInput("source", "This field is required.")
    match = NODE_SOURCE.fullmatch(source) if isinstance(source, str) else None
    if match is None:
        raise InvalidInput("source", "must be node-K, the sending agent's node (K a node number: node-0, node-1, …)")
    return int(match[1])


def check_ingest_batch(body: Any) -> tuple[str, list[dict[str, Any]]]:
    """An agent's batch `{"source", "events": [{"seq", "kind", "time"?, "data"?}]}`, checked in
    one pass: the source and the events, each with `seq`, `kind` (stripped), `time` (None when
    absent) and `data`. The first bad value raises, naming it as `events.3.kind`.

    Plain checks, not a serializer per event: at 1,000 points/s a DRF field per value was a
    tenth of the ingest's time, and this runs before any database work.
    """
    check_source(body)
    source = body["source"]
    raw_events = body.get("events")
    if raw_events is None:
        raise InvalidInput("events", "This field is required.")
    if not isinstance(raw_events, list):
        raise InvalidInput("events", "must be a list of events")
    if len(raw_events) > MAX_BATCH_EVENTS:
        raise InvalidInput("events", f"holds {len(raw_events)} events; at most {MAX_BATCH_EVENTS} per batch")
    events: list[dict[str, Any]] = []
    for index, raw in enumerate(raw_events):
        field = f"events.{index}"
        if not isinstance(raw, dict):
            raise InvalidInput(field, "must be an object with seq, kind, time and data")
        seq = raw.get("seq")
        if seq is None:
            raise InvalidInput(f"{field}.seq", "This field is required.")
        if not isinstance(seq, int) or isinstance(seq, bool):
            raise InvalidInput(f"{field}.seq", "A valid integer is required.")
        if seq < 1:
            raise InvalidInput(f"{field}.seq", "Ensure this value is greater than or equal to 1.")
        kind = raw.get("kind")
        if kind is None:
            raise InvalidInput(f"{field}.kind", "This field is required.")
        if not isinstance(kind, str) or not kind.strip():
            raise InvalidInput(f"{field}.kind", "must be a non-empty string")
        kind = kind.strip()
        if len(kind) > MAX_KIND_LENGTH:
            raise InvalidInput(f"{field}.kind", f"Ensure this field has no more than {MAX_KIND_LENGTH} characters.")
        when = raw.get("time")
        if when is not None and (
            not isinstance(when, (int, float)) or isinstance(when, bool) or not math.isfinite(when)
        ):
            raise InvalidInput(f"{field}.time", "must be a finite number (seconds since the epoch)")
        data = raw.get("data", {})
        if not isinstance(data, dict):
            raise InvalidInput(f"{field}.data", "must be an object")
        events.append({"seq": seq, "kind": kind, "time": when, "data": data})
    return source, events


def _event_time(value: Any) -> datetime:
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, tz=UTC)
    return timezone.now()


def _record(run: Run, kind: str, data: dict[str, Any], *, publish: bool = True) -> RunEvent:
    """Records an event of the control plane itself; call inside a transaction.

    `publish=False`: the caller publishes it with the batch it belongs to, in seq order."""
    seq = reserve_seqs(Run, run.pk, 1)
    event = RunEvent.objects.create(
        run=run, seq=seq, source=CONTROL_SOURCE, source_seq=seq, kind=kind, time=timezone.now(), data=data
    )
    if publish:
        publish_on_commit(run_group(run.pk), [event.as_message()])
    if kind in ("status", "cancelled") and data["status"] in RUN_EVENTS:
        # Every status change is recorded here (a queued run cancelled before it started as
        # `cancelled`, the others as `status`): the one place the owner's webhooks hear of it.
        notify_on_commit(run.owner_id, RUN_EVENTS[data["status"]], {"run": run.pk})
    return event


def do_record_event(run: Run, kind: str, data: dict[str, Any]) -> RunEvent:
    """Records an event of the control plane (an export, say) in the run's history."""
    with transaction.atomic():
        return _record(run, kind, data)


def do_note_waiting(run: Run, reason: str, **data: Any) -> bool:
    """A queued run's reason for waiting (the executor's queue, say), recorded as a `waiting`
    event when it changed; False when it had not, or the run left the queue."""
    with transaction.atomic():
        if not Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED).exclude(status_reason=reason).update(status_reason=reason):
            return False
        _record(run, "waiting", {"reason": reason, **data})
    return True


def do_ingest_events(run: Run, source: str, events: list[dict[str, Any]]) -> int:
    """Stores an agent's batch (duplicates ignored), applies it to the run, publishes after commit.

    `events` as `check_ingest_batch` returns them. Returns the highest `source_seq` held from
    this source, which the agent takes as its ack.

    A batch costs a fixed handful of statements whatever its size (the row lock, the source's
    highest seq, one INSERT, one UPDATE of the run), and one channel message: at 1,000 points/s
    the ingest's time per batch, not per event, is what a point waits for.
    """
    with transaction.atomic():
        # The run's row is locked first: two posts of one source (a retry racing the request it
        # repeats) are serialised, and what is read here holds until commit (on SQLite the
        # IMMEDIATE transaction serialises writers instead).
        row = (
            Run.objects.select_for_update()
            .values("last_seq", "status", "started_at", "node_reports", "silent_nodes", "cancel_requested", "preempted_by_id", "slurm_job_id")
            .get(pk=run.pk)
        )
        held_up_to = int(RunEvent.objects.filter(run=run, source=source).aggregate(top=Max("source_seq"))["top"] or 0)
        # Only a redelivery holds seqs at or below the source's highest: ask which, then.
        repeated = [e["seq"] for e in events if e["seq"] <= held_up_to]
        held: set[int] = set()
        if repeated:
            stored_again = RunEvent.objects.filter(run=run, source=source, source_seq__in=repeated)
            held.update(stored_again.values_list("source_seq", flat=True))
        fresh = sorted((e for e in events if e["seq"] not in held), key=lambda e: e["seq"])
        # A batch may repeat a seq within itself when a reporter retried mid-write.
        unique = list({e["seq"]: e for e in fresh}.values())
        changes: dict[str, Any] = {}
        stored: list[RunEvent] = []
        status: Run.Status | None = None
        if unique:
            _name_hosts(run, unique)
            first = int(row["last_seq"]) + 1
            stored = RunEvent.objects.bulk_create(
                RunEvent(
                    run=run,
                    seq=first + i,
                    source=source,
                    source_seq=e["seq"],
                    kind=e["kind"],
                    time=_event_time(e.get("time")),
                    data=e.get("data") or {},
                )
                for i, e in enumerate(unique)
            )
            changes["last_seq"] = first + len(stored) - 1
            observability.count_ingested(len(stored))  # counted once the batch commits
            status = _changes_from_events(run, stored, row["status"], changes)
            for event in stored:
                if event.kind in GUARD_EVENTS:
                    detail = {"kind": event.kind, **event.data}
                    notify_on_commit(run.owner_id, GUARD_EVENTS[event.kind], {"run": run.pk, "detail": detail})
        if status == Run.Status.FAILED and row["cancel_requested"]:
            # Each agent is stopped by a signal of its own: one that is not stopped yet when
            # another closes the rendezvous reports a failed rendezvous. The run was cancelled.
            status = Run.Status.CANCELLED
        moved = status is not None
        if moved:
            now = timezone.now()
            changes["status"] = status
            if status in Run.FINISHED:
                changes["finished_at"] = now
            if status == Run.Status.RUNNING and row["started_at"] is None:
                changes["started_at"] = now
            if status == Run.Status.RUNNING:
                changes["status_reason"] = ""  # a running run waits for nothing (a requeued job's reason goes)
        back_after = _note_report(source, row["node_reports"], row["silent_nodes"], changes)
        if changes:
            Run.objects.filter(pk=run.pk).update(**changes)
        # The control plane's own events follow the batch that caused them, in this order.
        if moved:
            # Every status change is an event, so a page that follows the events shows it.
            reason = changes.get("status_reason", "")
            stored.append(_record(run, "status", {"status": status, "reason": reason}, publish=False))
            if status in Run.FINISHED:
                _release_devices(run)
        stopped = next((e for e in stored if e.kind == "stopped"), None)
        if stopped is not None and not moved and not row["slurm_job_id"] and not row["cancel_requested"]:
            # (A Slurm job's `stopped` is its job's requeue, which watch_slurm_jobs follows.)
            stored += _requeue_stopped(run, row, stopped)
        if moved and status == Run.Status.SUCCEEDED:
            # The final checkpoint is exported to Hugging Face format as soon as the run succeeds
            # (once: each node agent of a multi-node run reports its own success).
            final = Checkpoint.objects.filter(run=run).order_by("-step").first()
            if final is not None:
                enqueue_on_commit("runs.tasks.export_checkpoint", final.pk)
        # A guard's rollback deletes the checkpoints of the steps it abandoned before it reports.
        if any(e.kind in ("checkpoint", "rolled_back") for e in stored) or status in Run.FINISHED:
            stored += _mark_pruned(run)
        if back_after is not None:
            stored.append(_record(run, "node_reporting", {"node": source, "silent_s": back_after}, publish=False))
        publish_on_commit(run_group(run.pk), [e.as_message() for e in stored])
    return max([held_up_to, *(e["seq"] for e in unique)])


# Events rank 0 reports about another rank, whose host only that rank's node agent knew.
_ABOUT_A_RANK = ("straggler", "straggler_cleared")


def _name_hosts(run: Run, events: list[dict[str, Any]]) -> None:
    """Adds the host to each event about a rank, from the last rendezvous that placed that rank
    (each node agent reports its host and ranks); in place."""
    about = [e for e in events if e.get("kind") in _ABOUT_A_RANK and isinstance(e.get("data"), dict)]
    if not about:
        return
    stored = RunEvent.objects.filter(run=run, kind="rendezvous").order_by("seq").values_list("data", flat=True)
    placements = [*stored, *(e["data"] for e in events if e.get("kind") == "rendezvous")]  # oldest first
    hosts: dict[int, str] = {}
    for data in placements:
        if isinstance(data, dict):
            hosts.update({rank: str(data.get("host", "")) for rank in data.get("ranks", []) if isinstance(rank, int)})
    for event in about:
        rank = event["data"].get("rank")
        if isinstance(rank, int) and rank in hosts:
            event["data"] = {**event["data"], "host": hosts[rank]}


def _changes_from_events(
    run: Run, events: list[RunEvent], status_now: str, changes: dict[str, Any]
) -> Run.Status | None:
    """Adds to `changes` (columns of the run's row) what an agent's events say; records the
    checkpoints they report. Returns the status they move the run to from `status_now`, if any.

    The events move it one after the other, each only where `_MOVES_FROM` allows: a queued run
    leaves the queue only by an agent's `agent_started`, so what the agents of an ended launch
    still report (the `cancelled` of the nodes a lost host left, stopped as their run was queued
    again) does not end the run that waits to resume."""
    changes["last_report_at"] = timezone.now()
    status: Run.Status | None = None
    current = status_now
    restarts = 0
    for event in events:
        data = event.data
        if event.kind == "metrics":
            changes.update(step=data.get("step", 0), last_loss=data.get("loss"), tokens_per_s=data.get("tokens_per_s"))
        elif event.kind == "checkpoint" or (event.kind == "resumed" and data.get("path")):
            # A run resumes only from a committed checkpoint: if the rank that committed it died
            # before reporting it, the resume reports it.
            checkpoint, _ = Checkpoint.objects.get_or_create(run=run, step=data["step"], defaults={"path": data["path"]})
            evaluated = isinstance(data.get("eval_loss"), (int, float))
            if event.kind == "checkpoint" and checkpoint.pruned_at is not None:
                # The guard rolled the run back past this step (its folder went) and it was saved again.
                Checkpoint.objects.filter(pk=checkpoint.pk).update(
                    path=data["path"], pruned_at=None, eval_loss=data["eval_loss"] if evaluated else None
                )
            elif evaluated and checkpoint.eval_loss is None:
                Checkpoint.objects.filter(pk=checkpoint.pk).update(eval_loss=data["eval_loss"])
        elif event.kind == "eval" and isinstance(data.get("eval_loss"), (int, float)):
            # A checkpoint reported before its step's evaluation arrived (a resume re-reports one).
            Checkpoint.objects.filter(run=run, step=data.get("step"), eval_loss__isnull=True).update(
                eval_loss=data["eval_loss"]
            )
        elif event.kind == "restarting":
            restarts += 1
        asked = _STATUS_BY_KIND.get(event.kind)
        if asked is not None and current in _MOVES_FROM[asked]:
            status = current = asked
            if asked in Run.FINISHED:
                changes["status_reason"] = data.get("reason", "")
    if restarts:
        changes["restarts"] = F("restarts") + restarts
    return status


# What checkpoint lists may be sorted by (`?ordering=`); a leading "-" is descending. Checkpoints
# without an eval loss come last either way: "deploy the best" means the best evaluated one.
CHECKPOINT_ORDERINGS = ("step", "-step", "eval_loss", "-eval_loss", "created_at", "-created_at")


def order_checkpoints(checkpoints: QuerySet[Checkpoint], ordering: str | None) -> QuerySet[Checkpoint]:
    """`checkpoints` in the order `?ordering=` names; None (no parameter): the model's order (run, step)."""
    if ordering is None:
        return checkpoints
    if ordering not in CHECKPOINT_ORDERINGS:
        raise InvalidInput("ordering", f"must be one of {', '.join(CHECKPOINT_ORDERINGS)}; got {ordering!r}")
    name = ordering.removeprefix("-")
    field = F(name).desc(nulls_last=True) if ordering.startswith("-") else F(name).asc(nulls_last=True)
    return checkpoints.order_by(field, "run", "step")


def _mark_pruned(run: Run) -> list[RunEvent]:
    """Marks the run's checkpoints whose folders the trainer deleted (`train.keep_checkpoints`).

    Rank 0 prunes before it reports the checkpoint that replaced them, so checking when a
    checkpoint event arrives (and when the run ends) catches every pruning."""
    pruned: list[RunEvent] = []
    for checkpoint in Checkpoint.objects.filter(run=run, pruned_at__isnull=True):
        on_object_storage = local_root(checkpoint.path) is None
        if is_committed_at(checkpoint.path) if on_object_storage else Path(checkpoint.path).exists():
            continue
        if Checkpoint.objects.filter(pk=checkpoint.pk, pruned_at__isnull=True).update(pruned_at=timezone.now()):
            data = {"step": checkpoint.step, "exported": bool(checkpoint.export_path)}
            pruned.append(_record(run, "checkpoint_pruned", data, publish=False))
    return pruned


def _note_report(source: str, reports: dict[str, Any], silent: list[str], changes: dict[str, Any]) -> float | None:
    """Keeps when each node agent last posted (into `changes`, from the locked row's values); a
    silent one that posts again is reported back: returns how long it was quiet, then."""
    if not source.startswith("node-"):
        return None
    now = timezone.now().timestamp()
    quiet = now - float(reports.get(source, now))
    changes["node_reports"] = {**reports, source: now}
    if source not in silent:
        return None
    changes["silent_nodes"] = [s for s in silent if s != source]
    return round(quiet, 1)


def do_mark_silent_nodes(run: Run, silent_after: float) -> list[str]:
    """Records `node_silent` for each node agent of an active run that has not posted for
    `silent_after` seconds; returns them. `_note_report` clears them when they post again."""
    now = timezone.now().timestamp()
    with transaction.atomic():
        row = Run.objects.select_for_update().filter(pk=run.pk, status__in=Run.ACTIVE).values("node_reports", "silent_nodes").first()
        if row is None:
            return []
        newly = [
            source for source, at in sorted(row["node_reports"].items())
            if now - float(at) > silent_after and source not in row["silent_nodes"]
        ]
        if newly:
            Run.objects.filter(pk=run.pk).update(silent_nodes=[*row["silent_nodes"], *newly])
            for source in newly:
                quiet = now - float(row["node_reports"][source])
                _record(run, "node_silent", {"node": source, "silent_s": round(quiet, 1), "threshold_s": silent_after})
    return newly


def run_group(run_id: int) -> str:
    return f"run-{run_id}"
