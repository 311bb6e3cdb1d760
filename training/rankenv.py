"""What a node agent tells each of its ranks, through environment variables.

The agent builds one `RankEnvironment` per rank and exports it with `to_environ()`; inside the
rank, `build_hooks` reads it back once with `from_environ()`. Keeping both directions in one
place means the names cannot drift apart. A rank started without an agent (a plain
`python -m training.train`) finds none of these variables and runs with no hooks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

RUN_DIR = "FATHOM_RUN_DIR"
NODE_RANK = "FATHOM_NODE_RANK"
ATTEMPT = "FATHOM_ATTEMPT"
HEARTBEAT_FILE = "FATHOM_HEARTBEAT_FILE"
HEARTBEAT_INTERVAL = "FATHOM_HEARTBEAT_INTERVAL"
EVENTS_FILE = "FATHOM_EVENTS_FILE"


@dataclass(kw_only=True, frozen=True)
class RankEnvironment:
    run_dir: Path
    node_rank: int  # the agent's --node-rank: which host this rank runs on
    attempt: int  # 0 on the first start of the job, +1 for every restart of the whole group
    heartbeat_file: Path  # where this rank's heartbeat thread writes (step, phase, time)
    heartbeat_interval: float  # seconds between heartbeats
    events_file: Path  # where rank 0 appends its JSON-lines events

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
            events_file=Path(env.get(EVENTS_FILE, str(run_dir / "events.jsonl"))),
        )

    def to_environ(self) -> dict[str, str]:
        return {
            RUN_DIR: str(self.run_dir),
            NODE_RANK: str(self.node_rank),
            ATTEMPT: str(self.attempt),
            HEARTBEAT_FILE: str(self.heartbeat_file),
            HEARTBEAT_INTERVAL: repr(self.heartbeat_interval),
            EVENTS_FILE: str(self.events_file),
        }

    @property
    def faults_dir(self) -> Path:
        """Markers of faults that have fired, shared by every node that sees the run folder."""
        return self.run_dir / "faults"
