"""Enqueueing Celery tasks after the current transaction commits, by the task's name.

Domain operations (`services`) queue the tasks that carry their work on, and those tasks call the
domain operations: naming the task instead of importing it keeps that an import in one direction
(tasks → services). The name is the task function's dotted path (Celery's default for
`shared_task`), e.g. "runs.tasks.launch_run".
"""

from __future__ import annotations

from typing import Any

from django.db import transaction

from controlplane.celery import app


def enqueue_on_commit(task: str, *args: Any) -> None:
    """Sends `task(*args)` to the workers once the transaction commits; nothing if it rolls back."""
    transaction.on_commit(lambda: app.send_task(task, args=args))


def enqueue_after(seconds: float, task: str, *args: Any) -> None:
    """Sends `task(*args)` now, for a worker to run `seconds` from now (Celery's countdown)."""
    app.send_task(task, args=args, countdown=seconds)
