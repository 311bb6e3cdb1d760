"""The Celery app: `celery -A controlplane worker` (with `-B` or a separate `beat`)."""

import os
import sys
from pathlib import Path

# Workers start from the repo root; the Django project lives in platform/ (a plain folder).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from celery import Celery  # noqa: E402

app = Celery("fathom")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
