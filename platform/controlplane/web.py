"""How Fathom's web process is started, in one place for `make run`, the tests and the benches.

uvicorn with uvloop and httptools serves HTTP and websockets (Channels) from one ASGI app. Its C
parsers matter on the OpenAI endpoint, where every generated token is an SSE event relayed
through this process (bench.serving prints the web process's CPU per 1000 relayed tokens).

uvicorn builds the app with `web_application` (a factory), so what only this long-lived process
needs happens here and not in every process that imports `controlplane.asgi` (tests, Celery).
"""

from __future__ import annotations

import sqlite3
import sys
from typing import Any

# The web process's own connection to an SQLite database (the embedded default), held open
# without a transaction for its whole life: see hold_sqlite_wal_open.
_wal_holder: sqlite3.Connection | None = None


def hold_sqlite_wal_open() -> None:
    """Keeps the SQLite write-ahead log open while the web process lives.

    Under ASGI every request runs in a thread of its own with a connection of its own, closed
    when the request ends. When the last connection to a WAL database closes, SQLite checkpoints
    the whole log into the database file and deletes it: each event ingest paid that (about 6
    ms, and a lock that made the next writer wait in SQLite's sleeping busy handler). One idle
    connection held here means no request's close is the last; the log is still checkpointed
    as it grows (SQLite's automatic checkpoint at each commit past 1,000 pages), and it holds no
    transaction, so it never blocks one.
    """
    global _wal_holder
    from django.conf import settings

    database = settings.DATABASES["default"]
    if _wal_holder is not None or not database["ENGINE"].endswith("sqlite3"):
        return
    holder = sqlite3.connect(database["NAME"], timeout=20, check_same_thread=False, isolation_level=None)
    holder.execute("PRAGMA journal_mode=WAL").fetchall()  # as every Django connection sets it
    holder.execute("SELECT count(*) FROM sqlite_master").fetchall()  # reads the file: maps the log's index
    _wal_holder = holder


def web_application() -> Any:
    """The ASGI application as the web process serves it (`uvicorn --factory`)."""
    from serving.app import freeze_startup_objects, relay_scheduling

    relay_scheduling()  # before any thread starts, so Django's database threads inherit it
    from controlplane.asgi import application

    hold_sqlite_wal_open()
    freeze_startup_objects()  # what Django, DRF, Channels and the apps built (~100,000 objects)
    return application


def web_command(port: int, host: str = "127.0.0.1", *, access_log: bool = False) -> list[str]:
    """The command line of a web process on `host:port`; run it from the platform/ folder."""
    command = [
        sys.executable, "-m", "uvicorn", "controlplane.web:web_application", "--factory",
        "--host", host, "--port", str(port),
        # websockets-sansio: uvicorn ≥ 0.35 warns (on stderr, as plain text) that "websockets" is deprecated.
        "--loop", "uvloop", "--http", "httptools", "--ws", "websockets-sansio",
        "--lifespan", "off",  # Channels' ProtocolTypeRouter has no lifespan handler
    ]  # fmt: skip
    if not access_log:
        command.append("--no-access-log")
    return command


if __name__ == "__main__":  # the container's entry: python -m controlplane.web [PORT]
    import os

    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    os.execv(sys.executable, web_command(port, "0.0.0.0", access_log=True))
