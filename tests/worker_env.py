"""Each pytest-xdist worker's own data folder and Redis database (loaded with `-p`, before Django
reads its settings).

The two workers of `make test` run side by side on one machine. Sharing FATHOM_DATA_DIR, they
would share the embedded default's SQLite test database and its filesystem broker: one worker's
Celery worker would take the other's tasks, and `purge_broker` would drop them. Sharing a Redis
database, they would share the broker's queues and the channel layer's groups (run 1 exists in
both workers' databases). PostgreSQL needs nothing here: pytest-django names each worker's test
database after it (test_fathom_gw0, ...).
"""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REPO = Path(__file__).resolve().parents[1]


def worker_redis_url(url: str, worker_index: int) -> str:
    """The URL's Redis database moved up by `worker_index` + 1 (gw0 takes 1, gw1 takes 2, ...):
    none of them is the database the URL names, which a run of the suite without workers uses."""
    parts = urlsplit(url)
    base = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{base + worker_index + 1}"))


worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...: set before this module loads
if worker:
    data_dir = Path(os.environ.get("FATHOM_DATA_DIR") or REPO / "var") / worker
    data_dir.mkdir(parents=True, exist_ok=True)
    os.environ["FATHOM_DATA_DIR"] = str(data_dir)
    if redis_url := os.environ.get("REDIS_URL"):
        os.environ["REDIS_URL"] = worker_redis_url(redis_url, int(worker.removeprefix("gw")))
