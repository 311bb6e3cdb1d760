"""Fathom's Prometheus metrics and `GET /metrics`, correct with any number of processes.

Each value is kept where it stays right across processes:

- **Counted where it happens, added up at scrape** (prometheus_client's multiprocess mode): what
  happens inside one process and is nowhere else recorded: `/v1` requests, their time to first
  token and tokens (observability_asgi.py), events ingested, websocket clients, HTTP 5xx, failed
  Celery tasks. Every process (each web process, each worker and its pool children) writes its
  own file in settings.METRICS_DIR; whichever web process is scraped adds all files up.
- **Read from the database at scrape** (observability_db.py): what the database already holds:
  runs by status, queue wait, deployments and replica states, KV-cache use (the worker's sync
  task stores each replica scrape as a deployment event). Any web process answers the same, and
  nothing is lost when a process restarts.

The metric folder: prometheus_client's docs want it wiped before the processes start. Fathom's
processes start one by one (web, worker, beat; separate containers in docker-compose.yml), so
each process holds an flock on `<its id>.alive` there while it lives, and a process that starts
while no other holds one wipes the folder. Counters and histograms of a process that died stay:
the totals an operator rates over must not drop because one web process restarted. Its live
gauges (websocket clients) go as soon as it is seen dead: at a process start and at each scrape.
Process ids are `<host>-<pid>`: containers sharing the data volume have pids of their own.
"""

from __future__ import annotations

import fcntl
import hmac
import os
import re
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from controlplane.processes import flock_held

# --- The metric folder -------------------------------------------------------------------------

_HOST = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()) or "host"


def process_id() -> str:
    # No "_": prometheus_client splits file names (`counter_<id>.db`) on it.
    return f"{_HOST}-{os.getpid()}"


def _forget_dead(folder: Path) -> None:
    """Removes the live gauges (and the `.alive` files) of processes that no longer run."""
    for alive in folder.glob("*.alive"):
        if not flock_held(alive):
            mark_process_dead(alive.stem, str(folder))
            alive.unlink(missing_ok=True)
    for gauge in folder.glob("gauge_live*_*.db"):
        owner = gauge.stem.split("_", 2)[2]
        if not (folder / f"{owner}.alive").exists():  # a process that died before it said it lives
            gauge.unlink(missing_ok=True)


class _Folder:
    """This process's place in the metric folder: its `.alive` lock, taken again after a fork."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._alive: dict[str, IO[str]] = {}

    def _guard(self) -> IO[str]:
        guard = (self.path / "folder.lock").open("a")
        fcntl.flock(guard, fcntl.LOCK_EX)  # released when closed
        return guard

    def join(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        with self._guard():
            if not any(flock_held(alive) for alive in self.path.glob("*.alive")):
                # No process of this install runs: a fresh start, as the client's docs want it.
                for stale in [*self.path.glob("*.db"), *self.path.glob("*.alive")]:
                    stale.unlink(missing_ok=True)
            else:
                _forget_dead(self.path)
            self._say_alive(process_id())

    def after_fork(self, pid: str) -> None:
        with self._guard():  # a sweep never sees the file between its creation and its lock
            self._say_alive(pid)

    def _say_alive(self, pid: str) -> None:
        if pid not in self._alive:
            alive = (self.path / f"{pid}.alive").open("a")
            fcntl.flock(alive, fcntl.LOCK_EX)  # held for the life of the process
            self._alive[pid] = alive

    def sweep(self) -> None:
        with self._guard():
            _forget_dead(self.path)


FOLDER = _Folder(settings.METRICS_DIR)


def _file_backed_values(folder: _Folder, current_id: Callable[[], str]) -> type:
    """prometheus_client's multiprocess value (values.MultiProcessValue), writing into `folder`.

    The library's own reads the folder from PROMETHEUS_MULTIPROC_DIR, which every child process
    would inherit: vLLM replicas (started by the worker's supervisor) would then write their
    series into it and sum them across replicas in their own /metrics, which Fathom scrapes per
    replica. Same file names and keys as the library's, so MultiProcessCollector and
    mark_process_dead read them."""
    files: dict[str, MmapedDict] = {}
    created: list[Any] = []
    owner = {"id": current_id()}
    lock = threading.Lock()

    class FileBackedValue:
        _multiprocess = True

        def __init__(self, typ: str, metric_name: str, name: str, labelnames: Any, labelvalues: Any,
                     help_text: str, multiprocess_mode: str = "", **kwargs: Any) -> None:  # fmt: skip
            self._params = typ, metric_name, name, labelnames, labelvalues, help_text, multiprocess_mode
            with lock:
                self._follow_fork()
                self._open()
                created.append(self)

        def _open(self) -> None:
            typ, metric_name, name, labelnames, labelvalues, help_text, mode = self._params
            prefix = f"gauge_{mode}" if typ == "gauge" else typ
            if prefix not in files:
                files[prefix] = MmapedDict(str(folder.path / f"{prefix}_{owner['id']}.db"))
            self._file = files[prefix]
            self._key = mmap_key(metric_name, name, labelnames, labelvalues, help_text)
            self._value, self._timestamp = self._file.read_value(self._key)

        def _follow_fork(self) -> None:
            """A forked child (Celery's prefork pool) writes files of its own, from zero."""
            now = current_id()
            if now != owner["id"]:
                owner["id"] = now
                folder.after_fork(now)
                for f in files.values():
                    f.close()
                files.clear()
                for value in created:
                    value._open()

        def inc(self, amount: float) -> None:
            with lock:
                self._follow_fork()
                self._value += amount
                self._timestamp = 0.0
                self._file.write_value(self._key, self._value, self._timestamp)

        def set(self, value: float, timestamp: float | None = None) -> None:
            with lock:
                self._follow_fork()
                self._value = value
                self._timestamp = timestamp or 0.0
                self._file.write_value(self._key, self._value, self._timestamp)

        def get(self) -> float:
            with lock:
                self._follow_fork()
                return self._value

        def set_exemplar(self, exemplar: Any) -> None:  # no exemplars in multiprocess mode
            return

        def get_exemplar(self) -> None:
            return None

    return FileBackedValue


FOLDER.join()
# Chosen before any metric is made, as the library does from its environment variable.
values.ValueClass = _file_backed_values(FOLDER, process_id)

# --- Metrics counted where they happen (registry=None: exported from the files, never twice) ----

# vLLM's buckets for time to first token (vllm:time_to_first_token_seconds), so both compare.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
V1_REQUESTS = Counter(
    "fathom_v1_requests", "Requests to the OpenAI-compatible endpoint, by deployment (served model name; "
    "empty when none could be told), endpoint and HTTP status.", ["deployment", "endpoint", "status"], registry=None,
)  # fmt: skip
V1_DURATION = Histogram(
    "fathom_v1_request_duration_seconds", "Time from a /v1 request's arrival to its last byte.",
    ["deployment", "endpoint"], buckets=TTFT_BUCKETS, registry=None,
)  # fmt: skip
V1_TTFT = Histogram(
    "fathom_v1_time_to_first_token_seconds", "Time from a streamed /v1 request's arrival to the first "
    "piece of its answer leaving Fathom.", ["deployment"], buckets=TTFT_BUCKETS, registry=None,
)  # fmt: skip
# The scope key under which the /v1 app reports an answer's usage: a list the observer puts in the
# scope before the app runs (a list, so that routers that copy the scope still share it), to
# which the app appends (prompt_tokens, completion_tokens).
V1_USAGE = "fathom.v1_usage"
V1_TOKENS = Counter(
    "fathom_v1_tokens", "Tokens of /v1 requests as vLLM reported them for each answer (streamed answers "
    "included, whether or not the client asked for usage), by kind: prompt or completion.",
    ["deployment", "kind"], registry=None,
)  # fmt: skip
HTTP_ERRORS = Counter(
    "fathom_http_errors", "HTTP answers with a 5xx status (or none: the app raised), by where: v1 (the "
    "OpenAI endpoint) or web (API, dashboard, admin).", ["where", "status"], registry=None,
)  # fmt: skip
TASK_FAILURES = Counter("fathom_task_failures", "Celery tasks that raised, by task.", ["task"], registry=None)
EVENTS_INGESTED = Counter(
    "fathom_run_events_ingested", "Events node agents posted that were stored (repeats of a retried batch "
    "are not counted).", registry=None,
)  # fmt: skip
# livesum: the clients of a process that died are not counted (its file goes when it is seen dead).
WEBSOCKET_CLIENTS = Gauge(
    "fathom_websocket_clients", "Open websocket connections, by stream (runs or deployments).", ["stream"],
    multiprocess_mode="livesum", registry=None,
)  # fmt: skip


def count_ingested(events: int) -> None:
    """Counts stored agent events; call inside the transaction that stores them."""
    from django.db import transaction

    if events:
        transaction.on_commit(lambda: EVENTS_INGESTED.inc(events))


# --- Celery ------------------------------------------------------------------------------------


def count_task_failure(sender: Any = None, **_: Any) -> None:
    """celery.signals.task_failure receiver."""
    TASK_FAILURES.labels(task=getattr(sender, "name", "unknown")).inc()


# --- GET /metrics --------------------------------------------------------------------------------


def _text(status: int, message: str) -> HttpResponse:
    return HttpResponse(message + "\n", status=status, content_type="text/plain; charset=utf-8")


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus text format, for a scraper holding FATHOM_METRICS_TOKEN as a bearer token."""
    if not settings.METRICS_TOKEN:
        return _text(403, "Metrics are off: set FATHOM_METRICS_TOKEN and scrape with 'Authorization: Bearer <it>'.")
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        response = _text(401, "Send 'Authorization: Bearer <FATHOM_METRICS_TOKEN>'.")
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    if not hmac.compare_digest(token.strip().encode(), settings.METRICS_TOKEN.encode()):
        return _text(403, "Wrong metrics token.")
    from controlplane.observability_db import DatabaseCollector

    FOLDER.sweep()
    registry = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(registry, path=str(FOLDER.path))
    registry.register(DatabaseCollector())
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
