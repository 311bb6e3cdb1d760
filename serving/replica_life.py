"""How one start of a replica ended, and what its log says killed it.

The supervisor (`serving.supervisor`) watches each start of a replica to its end; a start that
never became ready is judged by its log's error line (`engine_error`), and the same death at
every start in a row fails the replica instead of restarting it forever (`start_failure`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class Life:
    """How one start of a replica ended."""

    code: int | None  # exit status (negative: a signal); None: it never started
    message: str  # what happened, for the replica_died event
    killed_because: str = ""  # the supervisor killed it: why (then its exit status says nothing)
    became_ready: bool = False  # it answered /health and generated a token
    stayed_ready: bool = False  # it stayed ready for backoff_reset_s
    error: str = ""  # a start that failed: the last error line of its log (engine_error)


# vLLM's log prefix: "(EngineCore pid=16716) ERROR 12-05 07:27:12 [core.py:1512] "
_VLLM_PREFIX = re.compile(r"^(\(\w+ pid=\d+\) )?(\w+ \d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] )?")
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?([A-Z]\w*(?:Error|Exception)): \S")
# The API server's word for "the engine died", which names no cause: the cause is above it.
_WITHOUT_CAUSE = ("EngineDeadError", "EngineGenerateError")


def engine_error(log: str) -> str:
    """The line of a replica's log that says why its engine failed: the last exception that
    names a cause (`RuntimeError: Worker failed with error 'int8_scaled_mm_with_quant: expect A
    to be bfloat16 or half.'`), else a fatal signal (`Fatal Python error: Illegal instruction`),
    else the last ERROR line; without vLLM's process and time prefix. Empty if none."""
    lines = [_VLLM_PREFIX.sub("", line).strip() for line in log.splitlines()]
    for line in reversed(lines):
        match = _EXCEPTION_LINE.match(line)
        if match and match.group(1) not in _WITHOUT_CAUSE:
            return line[:1000]
    for line in reversed(lines):
        if line.startswith("Fatal Python error: "):
            return line[:1000]
    for raw in reversed(log.splitlines()):
        if " ERROR " in raw or raw.startswith("ERROR"):
            return _VLLM_PREFIX.sub("", raw).strip()[:1000]
    return ""


def read_from(path: Path, offset: int) -> str:
    """What was appended to a log since `offset` (its last 64 KiB: a traceback's end)."""
    try:
        with path.open("rb") as log:
            size = log.seek(0, os.SEEK_END)
            log.seek(max(offset, size - 65536))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def start_failure(starts: int, life: Life) -> str:
    said = life.error or "its log names no error"
    how = "at its only start" if starts == 1 else f"the same way at {starts} starts in a row"
    return f"failed {how} ({life.message}): {said}"
