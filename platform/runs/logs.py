"""Reading the per-rank log files the node agent writes under the run folder."""

from __future__ import annotations

from collections import deque

from runs.models import Run


def tail(run: Run, rank: int, lines: int) -> list[str]:
    path = run.run_dir.rank_log(rank)
    if not path.exists():
        return []
    with path.open("r", errors="replace") as f:
        return [line.rstrip("\n") for line in deque(f, maxlen=lines)]
