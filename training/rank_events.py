"""What rank 0 reports to its node agent: a JSON-lines events file the agent's uplink tails.

Event contract (one JSON object per line, appended and flushed line by line):

    {"kind": "metrics", "time": t, "step": n, "loss": f, "lr": f, "grad_norm": f,
     "tokens_per_s": f, "mfu": f, "step_time": f, "memory_mb": f}
    {"kind": "eval", "time": t, "step": n, "eval_loss": f, "eval_perplexity": f, "eval_tokens": n}
    {"kind": "checkpoint", "time": t, "step": n, "path": "<committed checkpoint dir>", "eval_loss": f}
        # eval_loss only when the step was evaluated (train.eval_interval)
    {"kind": "resumed", "time": t, "step": n, "path": "<its checkpoint dir>"}  # started from step n
    {"kind": "finished", "time": t, "step": n}

What the metrics mean is `training.metrics`'.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, TextIO

METRIC_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "memory_mb")


class EventLog:
    """Appends events to a JSON-lines file; each line is flushed so a tailing reader sees it at once.

    Thread-safe: a background checkpoint save reports its commit from its own thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "time": time.time(), **fields}
        line = json.dumps(event) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
