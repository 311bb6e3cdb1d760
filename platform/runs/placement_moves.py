"""What a placement pass records of runs (`hosts.scheduling.RunsSide`, inside the pass's
transaction): the placed runs' move to `starting` with their events, waiting reasons, and the
stop requests of runs preempted for a higher-priority one."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from django.db import connection, transaction
from django.db.models import Case, Value, When
from django.utils import timezone

from controlplane.bulk import insert_rows
from controlplane.events import publish_many_on_commit
from launch import executors
from runs.models import Run, RunEvent
from runs.services import CONTROL_SOURCE, do_record_event, run_group


def do_move_to_starting(placements: list[tuple[int, int, str, list[dict[str, Any]]]]) -> list[int]:
    """Moves queued runs to `starting` where a placement pass put them (each: its id, the
    `last_seq` the pass read, the endpoint its agents meet at and its nodes: host, address,
    devices), inside the pass's transaction, and records their `placed` and status events: one
    UPDATE and one INSERT whatever their number. A run that moved on since the pass read it
    (cancelled, or an event numbered) is left out. Returns the runs moved."""
    now = timezone.now()
    table = Run._meta.db_table
    moved: set[int] = set()
    for chunk in range(0, len(placements), 1000):
        part = placements[chunk : chunk + 1000]
        # Each run its own endpoint and expected last_seq, from one VALUES list; the conditions
        # hold under the row locks the UPDATE takes (PostgreSQL and SQLite ≥ 3.35 alike).
        with connection.cursor() as cursor:
            cursor.execute(
                f"UPDATE {table} SET status = %s, status_reason = '', launch_attempts = launch_attempts + 1, "
                f"last_report_at = %s, last_seq = last_seq + 2, reservation = %s, rendezvous = v.column2 "
                f"FROM (VALUES {', '.join(['(%s, %s, %s)'] * len(part))}) AS v "
                f"WHERE {table}.id = v.column1 AND {table}.status = %s AND NOT {table}.cancel_requested "
                f"AND {table}.last_seq = v.column3 RETURNING {table}.id",
                [Run.Status.STARTING, connection.ops.adapt_datetimefield_value(now), "{}",
                 *(value for run_id, last_seq, endpoint, _ in part for value in (run_id, endpoint, last_seq)),
                 Run.Status.QUEUED],
            )  # fmt: skip
            moved.update(row[0] for row in cursor.fetchall())
    # `starting` is no status the owner's webhooks hear of (notifications.events.RUN_EVENTS).
    events = [
        (run_id, seq, kind, data)
        for run_id, last_seq, _, nodes in placements if run_id in moved
        for seq, kind, data in (
            (last_seq + 1, "placed", {"nodes": nodes}),
            (last_seq + 2, "status", {"status": Run.Status.STARTING, "reason": ""}),
        )
    ]  # fmt: skip
    stored_at = connection.ops.adapt_datetimefield_value(now)
    insert_rows(
        RunEvent, ["run", "seq", "source", "source_seq", "kind", "time", "data"],
        ((run_id, seq, CONTROL_SOURCE, seq, kind, stored_at, json.dumps(data)) for run_id, seq, kind, data in events),
    )  # fmt: skip
    by_group: dict[str, list[dict[str, Any]]] = {}
    for run_id, seq, kind, data in events:
        by_group.setdefault(run_group(run_id), []).append(RunEvent.message(seq, kind, now, data, source=CONTROL_SOURCE))
    publish_many_on_commit(by_group)
    return [run_id for run_id, _, _, _ in placements if run_id in moved]


def do_note_waiting_many(reasons: Mapping[str, list[int]]) -> None:
    """Waiting reasons of many queued runs (each reason: the runs it holds back, a quota's say),
    in one UPDATE and without an event each: the runs' pages read them with the row."""
    if not reasons:
        return
    Run.objects.filter(pk__in=[pk for run_ids in reasons.values() for pk in run_ids], status=Run.Status.QUEUED).update(
        status_reason=Case(*(When(pk__in=run_ids, then=Value(reason)) for reason, run_ids in reasons.items()))
    )


def do_preempt(run: Run, by: Run) -> bool:
    """Asks `run` to make room for the higher-priority `by` (a placement pass's choice, inside its
    transaction): its ranks checkpoint the step they agree on and stop, and when its agents say
    `stopped` it goes back to the queue to resume from there. False if it ended or was asked
    already; the stop request is sent again (`request_stop`) until it stops."""
    if not Run.objects.filter(pk=run.pk, status__in=Run.ACTIVE, preempted_by__isnull=True).exclude(
        status=Run.Status.QUEUED
    ).update(preempted_by=by):
        return False
    reason = f"preempted by run {by.pk} (priority {by.priority} over {run.priority})"
    do_record_event(run, "preempt_requested", {"by": by.pk, "priority": by.priority, "reason": reason})
    run.preempted_by = by
    transaction.on_commit(lambda: executors.for_run(run).request_stop(run, reason))
    return True


def request_stop(run: Run) -> None:
    """The stop request of a run being preempted, again (a pass sends it while the run runs on)."""
    if run.preempted_by_id is not None:
        reason = f"preempted by run {run.preempted_by_id}"
        transaction.on_commit(lambda: executors.for_run(run).request_stop(run, reason))
