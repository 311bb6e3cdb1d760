"""Shared cast and real processes for control-plane tests.

The cast (alice, bob) follows healthchecks' BaseTestCase. `live_web` and `celery_worker` start
real web (uvicorn) and Celery processes against the test database, so tests that use them must be
`transaction=True` (their data has to be committed for other processes to see it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from django.conf import settings
from django.db import connection
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from controlplane.web import web_command
from hostworker.config import HostConfig
from hostworker.heartbeat import secret_file
from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]



@pytest.fixture
def alice(django_user_model):
    return django_user_model.objects.create_user("alice", password="alice-password-1")


@pytest.fixture
def bob(django_user_model):
    return django_user_model.objects.create_user("bob", password="bob-password-1")


@pytest.fixture
def charlie(django_user_model):
    return django_user_model.objects.create_user("charlie", password="charlie-password-1")


def client_for(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.get_or_create(user=user)[0].key}")
    return client


@pytest.fixture
def alice_api(alice) -> APIClient:
    return client_for(alice)


@pytest.fixture
def bob_api(bob) -> APIClient:
    return client_for(bob)


@pytest.fixture
def charlie_api(charlie) -> APIClient:
    return client_for(charlie)


def database_url() -> str:
    """The URL of the database this test runs on, for processes the test starts."""
    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    return f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def process_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, DATABASE_URL=database_url(), FATHOM_DATA_DIR=str(settings.DATA_DIR), OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def wait_for_http(url: str, timeout: float = 60.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode}")
        try:
            httpx.get(url, timeout=1.0)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class WebServer:
    def __init__(self, port: int, log: Path, env: dict[str, str] | None = None) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.env = env or {}
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        # free_port() only finds a port free for a moment: another process may bind it before
        # uvicorn does, which then exits with 3 ("address already in use"). Take another port.
        for attempt in range(3):
            logged = self.log.stat().st_size if self.log.exists() else 0
            with self.log.open("ab") as out:
                self.process = subprocess.Popen(
                    web_command(self.port),
                    cwd=REPO / "platform",
                    env=process_env(FATHOM_PUBLIC_URL=self.url, **self.env),
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            try:
                wait_for_http(f"{self.url}/login/", process=self.process)
                return
            except RuntimeError:
                said = self.log.read_bytes()[logged:].decode(errors="replace")
                if "address already in use" not in said or attempt == 2:
                    raise RuntimeError(f"the web process exited with {self.process.returncode}:\n{said[-3000:]}") from None
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


@contextmanager
def serving(server: WebServer) -> Iterator[WebServer]:
    """Starts `server` as the control plane's public URL; stops it after."""
    server.start()
    # Agents and tasks started from this process post their events to this server.
    old = settings.PUBLIC_URL
    settings.PUBLIC_URL = server.url
    try:
        yield server
    finally:
        settings.PUBLIC_URL = old
        server.stop()


@pytest.fixture
def live_web(transactional_db, tmp_path) -> Iterator[WebServer]:
    with serving(WebServer(free_port(), tmp_path / "web.log")) as server:
        yield server


def purge_broker() -> None:
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        for message in (settings.BROKER_DIR / "queue").iterdir():
            message.unlink(missing_ok=True)
    else:
        from controlplane.celery import app

        app.control.purge()


class CeleryWorker:
    """A real Celery worker. `supervised`: started again whenever it exits by itself, as
    docker-compose's restart policy does (kombu's Redis transport can end the worker with an
    "Unrecoverable error" when the broker restarts while a message is unacknowledged)."""

    def __init__(
        self, log: Path, public_url: str, beat: bool = False, env: dict[str, str] | None = None, supervised: bool = False
    ) -> None:
        self.log = log
        self.public_url = public_url
        self.beat = beat
        self.env = env or {}
        self.process: subprocess.Popen | None = None
        self._stopping = threading.Event()
        if supervised:
            threading.Thread(target=self._supervise, name="worker-supervisor", daemon=True).start()

    def _supervise(self) -> None:
        while not self._stopping.wait(1):
            if self.process is not None and self.process.poll() is not None and not self._stopping.is_set():
                with self.log.open("a") as out:
                    out.write(f"\n[supervisor] the worker exited with {self.process.returncode}; starting it again\n")
                self.start()

    def start(self) -> None:
        # With beat, periodic tasks run as in production, on short intervals so tests stay quick.
        extra = ["-B", "--schedule", str(self.log.with_suffix(".beat"))] if self.beat else []
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--pool=threads", "--concurrency=4",
                 "--loglevel=INFO", "--without-gossip", "--without-mingle", "--without-heartbeat", *extra],
                cwd=REPO / "platform",
                env=process_env(
                    FATHOM_PUBLIC_URL=self.public_url, FATHOM_DEPLOYMENT_SYNC_INTERVAL="1", FATHOM_RECONCILE_INTERVAL="5",
                    **self.env,
                ),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        self._stopping.set()
        if self.process is not None:
            stop(self.process)


@pytest.fixture
def celery_worker(transactional_db, tmp_path) -> Iterator[CeleryWorker]:
    # Messages left by earlier tests name rows that no longer exist (or ids reused since).
    purge_broker()
    worker = CeleryWorker(tmp_path / "worker.log", settings.PUBLIC_URL)
    worker.start()
    yield worker
    worker.stop()


@pytest.fixture
def celery_worker_with_beat(transactional_db, tmp_path) -> Iterator[CeleryWorker]:
    purge_broker()
    worker = CeleryWorker(tmp_path / "worker.log", settings.PUBLIC_URL, beat=True)
    worker.start()
    yield worker
    worker.stop()


class HostWorker:
    """A real host worker (`python -m hostworker`), optionally inside a network namespace
    (`prefix`: ["ip", "netns", "exec", NAME])."""

    def __init__(self, name: str, log: Path, public_url: str, join_token: str, cpu_slots: int = 2,
                 address: str | None = None, prefix: list[str] | None = None, **env: str) -> None:  # fmt: skip
        self.name = name
        self.log = log
        self.env = process_env(
            FATHOM_PUBLIC_URL=public_url, FATHOM_JOIN_TOKEN=join_token, FATHOM_HOST_NAME=name,
            FATHOM_HOST_CPU_SLOTS=str(cpu_slots), FATHOM_HOST_HEARTBEAT_S="1", **env,
        )  # fmt: skip
        if address:
            self.env["FATHOM_HOST_ADDRESS"] = address
        self.prefix = prefix or []
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [*self.prefix, sys.executable, "-m", "hostworker"], cwd=REPO, env=self.env,
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        return self.process

    def holds_its_secret(self) -> bool:
        """Whether the worker kept the secret its join was answered with: one stopped before
        then is refused when it starts again (the join token no longer speaks for its name)."""
        return secret_file(HostConfig.from_env(**self.env)).exists()

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
