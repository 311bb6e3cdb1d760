"""The processes the control plane starts and leaves running: node agents, rendezvous stores,
replica supervisors. Each outlives the Celery task that starts it, so it gets a session of its
own, and the control plane later asks only whether its pid still lives."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

from django.conf import settings

# Whether a pid still lives: one answer for the control plane and the host worker, which owns it
# (it runs without Django).
from hostworker.processes import is_alive

__all__ = ["flock_held", "is_alive", "python_env", "start_detached"]


def python_env() -> dict[str, str]:
    """The environment of a `python -m` the control plane starts: the repository importable, one
    compute thread unless the process sets its own (they share the host's cores)."""
    return dict(os.environ, PYTHONPATH=str(settings.REPO_DIR), OMP_NUM_THREADS="1")


def start_detached(command: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Starts `command` in a session of its own (it survives the worker that started it), with
    stdout and stderr appended to `log`; returns its pid."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        process = subprocess.Popen(
            command, cwd=settings.REPO_DIR, env=python_env() if env is None else env,
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    return process.pid




def flock_held(path: Path) -> bool:
    """Whether some live process holds a flock on `path`; asks without keeping it (a missing
    file is held by nobody)."""
    try:
        with path.open("a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False
    except FileNotFoundError:
        return False


