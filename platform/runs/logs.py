"""The per-rank log files under the run folder: read for the log API, and, for a host that
keeps the run's folder to itself, the copy its agent ships here (`training.agent.log_shipper`)."""

from __future__ import annotations

import fcntl
import json
import os
from collections import deque
from pathlib import Path

from controlplane.exceptions import InvalidInput
from runs.models import Run
from training.run_dir import LOG_NAME

# What one shipped piece may carry (the shipper sends 256 KiB; this leaves room, bounds a request).
MAX_PIECE_BYTES = 1024 * 1024


def tail(run: Run, rank: int, lines: int) -> list[str]:
    path = run.run_dir.rank_log(rank)
    if not path.exists():
        return []
    with path.open("r", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=lines)]


def shared_with_agent(run: Run, node: int, probe: str) -> bool:
    """Whether the agent of `node` writes to this very folder (one machine): its probe is here."""
    try:
        return run.run_dir.node(node).log_probe_file.read_text() == probe
    except (OSError, ValueError):
        return False


def append_shipped(run: Run, address: str, name: str, offset: int, data: bytes) -> int:
    """Appends to our copy of log `name` what it lacks of the file of the host at `address`, given `data` read there
    from `offset`; returns where our copy of that host's file now ends (the shipper's next offset).

    Bytes we already hold (a chunk sent again) are skipped; a chunk past what we hold is refused
    by answering where we are. Several hosts may write one file over a run's life (a run resumed
    elsewhere): each host's bytes are counted apart, under a lock, so two posts never interleave."""
    if not LOG_NAME.fullmatch(name):
        raise InvalidInput("file", f"must be a log of the run folder (rank<R>.log, agent-node<K>.log, …); got {name!r}")
    run_dir = run.run_dir
    run_dir.logs_dir.mkdir(parents=True, exist_ok=True)
    return append_past(run_dir.shipped_logs_file, run_dir.logs_dir / name, f"{address}/{name}", offset, data)


def append_past(ledger_file: Path, copy_file: Path, key: str, offset: int, data: bytes) -> int:
    """Appends to `copy_file` what it lacks of the file `key` names on a host, given `data` read
    there from `offset`; returns where our copy of that file now ends. `ledger_file` counts the
    bytes held per key, under a lock (a run's logs, a deployment's shipped folder)."""
    with open(ledger_file, "a+") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        ledger.seek(0)
        held: dict[str, int] = json.loads(ledger.read() or "{}")
        end = held.get(key, 0)
        if offset > end or offset + len(data) <= end:
            return end
        with open(copy_file, "ab") as copy:
            copy.write(data[end - offset :])
            copy.flush()
            os.fsync(copy.fileno())
        held[key] = offset + len(data)
        ledger.seek(0)
        ledger.truncate()
        ledger.write(json.dumps(held, sort_keys=True))
        return held[key]
