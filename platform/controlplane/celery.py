"""The Celery app: `celery -A controlplane worker` (with `-B` or a separate `beat`)."""

import os
import sys
from pathlib import Path
from typing import Any

# The repo root holds training/ and serving/; platform/ holds the Django project and apps.
for _folder in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from celery import Celery

app = Celery("fathom")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# --- Worker hooks for observability (controlplane/observability.py) ---------------------------

from celery.signals import celeryd_after_setup, setup_logging, task_failure
from django.conf import settings


@task_failure.connect
def _count_task_failure(sender: object = None, **kwargs: object) -> None:
    # Imported here, in the process that runs tasks (a prefork child has its own metric file).
    from controlplane.observability import count_task_failure

    count_task_failure(sender)


if settings.LOG_FORMAT == "json":
    # Celery replaces the root logger's handlers with its own text format unless a receiver of
    # setup_logging configures logging instead: LOGGING's, the same as the web process's.
    @setup_logging.connect
    def _json_logs(**kwargs: object) -> None:
        from controlplane.observability_logs import configure

        configure(settings.LOGGING)

    @celeryd_after_setup.connect
    def _no_banner(instance: Any, **kwargs: object) -> None:
        # The worker prints its startup banner (queues, tasks) straight to stdout, not as a log
        # record; `celery -q` would skip it too. (Its one "Warm shutdown" line stays plain text.)
        instance.quiet = True
