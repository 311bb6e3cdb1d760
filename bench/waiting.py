"""Waiting on the processes a bench starts: a condition to come true, a server to answer."""

from __future__ import annotations

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


def answers(url: str) -> bool:
    """Whether something answers HTTP at `url` (any status)."""
    import httpx

    try:
        httpx.get(url, timeout=1)
        return True
    except httpx.HTTPError:
        return False
