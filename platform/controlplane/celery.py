"""The Celery app: `celery -A controlplane worker` (with `-B` or a separate `beat`)."""

import os
import sys
from pathlib import Path

# The repo root holds training/ and serving/; platform/ holds the Django project and apps.
for _folder in (Path(__file__).resolve().parents[2], Path(__file__).resolve().parents[1]):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

from celery import Celery

app = Celery("fathom")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
