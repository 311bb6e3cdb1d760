"""The processes a bench starts: waiting for a condition or a server, and stopping them all."""

from __future__ import annotations

import subprocess
import time
from typing import Any


def wait(predicate: Any, timeout: float, what: str) -> Any:
    """`predicate()`'s first truthy value, polled every 0.1 s for up to `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise TimeoutError(f"no {what} within {timeout} s")


def free_port() -> int:
    """A port for a server the bench starts (web process, broker, router, proxy): free now, and
    below the ephemeral range and the product's rank-store, replica and rendezvous ranges
    (training/ports.py), so no connection of the busy bench takes it before the server binds it."""
    from training.ports import RANK_STORE_PORTS, listen_port

    return listen_port(range(20000, RANK_STORE_PORTS.start))


def answers(url: str) -> bool:
    """Whether something answers HTTP at `url` (any status)."""
    import httpx

    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False


def stop_all(processes: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM to each, the last started first; SIGKILL to any still running 20 s later."""
    for process in reversed(processes):
        process.terminate()
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
