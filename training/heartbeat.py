"""A rank's pulse: a background thread that tells its node agent "alive, at step s, in phase p".

Each rank rewrites one small JSON file every `interval` seconds (atomically: a temporary file
renamed over the old one, so the agent never reads half a beat). The agent's watchdog reads the
file's `time`; a rank whose last beat is older than `nodes.heartbeat_timeout` is declared hung.

The beat comes from a thread, not from the training loop, on purpose: a step may take minutes on
a large model, and a rank blocked in a collective waiting for a slow peer is not hung. What stops
the beat is the whole process stopping: SIGSTOP, a debugger, a machine swapping itself to death,
a deadlock that holds the GIL. A collective that never returns is caught by the process group's
own timeout, which raises in the rank and ends it; the agent notices the exit.

The same hook registers `faulthandler` on SIGUSR1, so the agent can make a hung rank print
every thread's stack into its log before killing it.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STACK_DUMP_SIGNAL = signal.SIGUSR1


@dataclass(kw_only=True, frozen=True)
class Beat:
    rank: int
    pid: int
    step: int  # the optimizer step in progress or last finished; 0 before the first
    phase: str  # "starting", "step", "between_steps", "checkpoint", "done"
    time: float  # time.time() when written

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.time


def read_beat(path: Path) -> Beat | None:
    """The last beat written to `path`, or None when the rank has not beaten yet."""
    try:
        data = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return Beat(**data)


class HeartbeatHook:
    """TrainHook that beats from a daemon thread; the hooks only update step and phase."""

    def __init__(self, path: Path, rank: int, interval: float) -> None:
        self._path = path
        self._tmp = path.with_name(path.name + ".tmp")
        self._rank = rank
        self._interval = interval
        self._step = 0
        self._phase = "starting"
        self._stop = threading.Event()
        path.parent.mkdir(parents=True, exist_ok=True)
        # Stacks go to stderr, which the agent captures into the rank's log.
        faulthandler.register(STACK_DUMP_SIGNAL, file=sys.stderr, all_threads=True)
        self._write()
        self._thread = threading.Thread(target=self._run, name="fathom-heartbeat", daemon=True)
        self._thread.start()

    def on_step_start(self, step: int, params: list[Any]) -> None:
        self._step, self._phase = step, "step"

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        self._step, self._phase = step, "between_steps"

    def after_backward(self, step: int, params: list[Any]) -> None:
        pass

    def before_checkpoint_commit(self, step: int, staging_dir: Path | str) -> None:
        self._phase = "checkpoint"

    def close(self) -> None:
        self._phase = "done"
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1.0)
        self._write()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._write()
            except OSError:
                # A full disk or a removed folder must not kill training; the agent will
                # see the beat go stale and decide.
                pass

    def _write(self) -> None:
        beat = {"rank": self._rank, "pid": os.getpid(), "step": self._step, "phase": self._phase, "time": time.time()}
        self._tmp.write_text(json.dumps(beat))
        os.replace(self._tmp, self._path)
