"""What a node agent tells each of its ranks, through environment variables.

The agent builds one `RankEnvironment` per rank and exports it with `to_environ()`; inside the
rank, `build_hooks` reads it back once with `from_environ()`. Keeping both directions in one
place means the names cannot drift apart. A rank started without an agent (a plain
`python -m training.train`) finds none of these variables and runs with no hooks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from training.run_dir import RunDir

RUN_DIR = "FATHOM_RUN_DIR"
NODE_RANK = "FATHOM_NODE_RANK"
ATTEMPT = "FATHOM_ATTEMPT"
HEARTBEAT_FILE = "FATHOM_HEARTBEAT_FILE"
HEARTBEAT_INTERVAL = "FATHOM_HEARTBEAT_INTERVAL"
EVENTS_FILE = "FATHOM_EVENTS_FILE"
ERROR_FILE = "FATHOM_ERROR_FILE"
STOP_REQUEST_FILE = "FATHOM_STOP_REQUEST_FILE"
DOWNLOAD_CACHE = "FATHOM_DOWNLOAD_CACHE"

# Failures that no restart can cure: the same input fails the same way on every attempt.
# "training": the run diverged (its loss or gradients stayed non-finite, training/guard.py).
ErrorClass = Literal["data", "spec", "tokenizer", "training"]
# A rank's exit status after it wrote such an error to its error file (sysexits' EX_CONFIG).
NON_RETRYABLE_EXIT = 78
# A rank's exit status after it checkpointed and stopped because its stop request asked it to
# (sysexits' EX_TEMPFAIL: the run is unfinished and goes on in the scheduler's next job).
SAVED_AND_STOPPED_EXIT = 75


class NonRetryable(Exception):
    """An error that every restart would meet again (bad data, a spec this rank refuses, a broken
    tokenizer, a diverged run): the rank reports it and the agent fails the run at once instead
    of retrying."""

    def __init__(self, error_class: ErrorClass, message: str) -> None:
        super().__init__(message)
        self.error_class = error_class


@dataclass(kw_only=True, frozen=True)
class RankError:
    """What a rank reports before it exits with NON_RETRYABLE_EXIT: the agent fails the run with it."""

    error_class: ErrorClass
    message: str

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"error_class": self.error_class, "message": self.message}))
        os.replace(tmp, path)  # the agent never reads half a report

    @classmethod
    def read(cls, path: Path) -> RankError | None:
        """The report in `path`, or None when there is none (or it is not one of ours)."""
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("error_class") not in get_args(ErrorClass):
            return None
        return cls(error_class=data["error_class"], message=str(data.get("message", "")))


@dataclass(kw_only=True, frozen=True)
class RankEnvironment:
    run_dir: Path
    node_rank: int  # the agent's --node-rank: which host this rank runs on
    attempt: int  # 0 on the first start of the job, +1 for every restart of the whole group
    heartbeat_file: Path  # where this rank's heartbeat thread writes (step, phase, time)
    heartbeat_interval: float  # seconds between heartbeats
    events_file: Path  # where rank 0 appends its JSON-lines events
    # Where the rank reports an error no restart can cure (`RankError`) before it exits.
    error_file: Path | None = None
    # Where a scheduler asks the ranks to checkpoint at their next step and stop
    # (`RunDir.stop_request`); None where nobody asks, and the ranks then spend nothing looking.
    stop_request_file: Path | None = None
    # Where datasets on object storage are downloaded and checked, once a machine; None: the
    # run's data folder (a rank started without an agent).
    download_cache: Path | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RankEnvironment | None:
        """The agent's instructions, or None when the rank was not started by an agent."""
        env = os.environ if environ is None else environ
        if RUN_DIR not in env or HEARTBEAT_FILE not in env:
            return None
        run_dir = Path(env[RUN_DIR])
        return cls(
            run_dir=run_dir,
            node_rank=int(env.get(NODE_RANK, "0")),
            attempt=int(env.get(ATTEMPT, "0")),
            heartbeat_file=Path(env[HEARTBEAT_FILE]),
            heartbeat_interval=float(env.get(HEARTBEAT_INTERVAL, "0.1")),
            events_file=Path(env.get(EVENTS_FILE, str(RunDir(run_dir).events_file))),
            error_file=Path(env[ERROR_FILE]) if env.get(ERROR_FILE) else None,
            stop_request_file=Path(env[STOP_REQUEST_FILE]) if env.get(STOP_REQUEST_FILE) else None,
            download_cache=Path(env[DOWNLOAD_CACHE]) if env.get(DOWNLOAD_CACHE) else None,
        )

    def to_environ(self) -> dict[str, str]:
        return {
            RUN_DIR: str(self.run_dir),
            NODE_RANK: str(self.node_rank),
            ATTEMPT: str(self.attempt),
            HEARTBEAT_FILE: str(self.heartbeat_file),
            HEARTBEAT_INTERVAL: repr(self.heartbeat_interval),
            EVENTS_FILE: str(self.events_file),
            **({ERROR_FILE: str(self.error_file)} if self.error_file else {}),
            **({STOP_REQUEST_FILE: str(self.stop_request_file)} if self.stop_request_file else {}),
            **({DOWNLOAD_CACHE: str(self.download_cache)} if self.download_cache else {}),
        }
