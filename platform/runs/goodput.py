"""Where a run's wall time went, from the events it already reported: its goodput ledger.

Pure: `ledger(events)` takes a run's events in order and splits the time from its first event
to its last into buckets, each second in exactly one:

- `queued`: waiting for a place (queued, waiting, preempted), until an agent starts;
- `startup`: from an agent's start (or a restart's) to the first step it finishes;
- `productive`: the steps trained for the first time and kept, less their stalls below;
- `checkpoint`: what a step's gap took beyond the run's median step where a checkpoint was
  saved in it, and the last save before the run ended;
- `evaluation`: the same where an evaluation ran;
- `down`: from a rank's failure (or a lost node or host) until the restarted ranks finish a step;
- `replayed`: steps trained again after a restart resumed from an older state;
- `rolled_back`: steps the guard abandoned when it rolled the run back, and the rollback itself;
- `other`: what is left (a stop's save and shutdown, gaps no event explains).

A step's time is the gap between the metrics of consecutive steps (rank 0 reports each as it
ends); the control plane's clock orders nothing here, each event's own time does.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

BUCKETS = ("productive", "queued", "startup", "checkpoint", "evaluation", "down", "replayed", "rolled_back", "other")

_QUEUED = ("queued", "waiting", "preempted", "preempt_requested")
_STARTING = ("agent_started", "rendezvous", "restarting")
_DOWN = ("rank_failed", "node_lost", "host_lost")
_ENDED = ("succeeded", "failed", "cancelled", "stopped")


@dataclass
class _Step:
    seconds: float
    replayed: bool
    saved: bool  # a checkpoint was committed in its gap
    evaluated: bool
    abandoned: bool = False  # a rollback went back past it


@dataclass
class Ledger:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BUCKETS, 0.0))

    @property
    def wall_s(self) -> float:
        return sum(self.seconds.values())

    @property
    def goodput(self) -> float | None:
        """The share of the wall time spent on productive steps."""
        return self.seconds["productive"] / self.wall_s if self.wall_s > 0 else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "goodput": None if self.goodput is None else round(self.goodput, 4),
            "seconds": {name: round(value, 3) for name, value in self.seconds.items()},
        }


def ledger(events: Iterable[tuple[str, float, dict[str, Any]]]) -> Ledger:
    """The ledger of a run's events, as (kind, time, data) in the order they were stored."""
    result = Ledger()
    spent: list[_Step] = []  # every step's gap, replays included
    latest: dict[int, _Step] = {}  # the last record of each step, which a rollback abandons
    mode = "queued"  # the phase the time since `cursor` belongs to
    cursor: float | None = None
    newest = 0  # the newest step trained so far: a step at or below it is trained again
    saved = evaluated = False  # a checkpoint or an evaluation since the last step's metrics
    for kind, time, data in events:
        if cursor is None:
            cursor = time
        gap = max(0.0, time - cursor)
        if kind in ("checkpoint", "eval"):
            saved, evaluated = saved or kind == "checkpoint", evaluated or kind == "eval"
            continue
        if kind == "metrics" and isinstance(data.get("step"), int):
            step = data["step"]
            if mode == "stepping":
                record = _Step(gap, replayed=step <= newest, saved=saved, evaluated=evaluated)
                spent.append(record)
                latest[step] = record
            else:  # the first step after a start, a failure or a rollback ends that phase
                result.seconds[_phase_bucket(mode)] += gap
            newest = max(newest, step)
            mode, saved, evaluated = "stepping", False, False
        elif kind == "rolled_back":
            result.seconds["rolled_back" if mode == "stepping" else _phase_bucket(mode)] += gap
            target = data.get("to_step")
            if isinstance(target, int):
                # The steps after the state rolled back to were trained for nothing.
                for step in [s for s in latest if s > target]:
                    latest.pop(step).abandoned = True
                newest = min(newest, target)
            mode = "rollback"
        elif kind in _DOWN:
            result.seconds["down" if mode == "stepping" else _phase_bucket(mode)] += gap
            mode = "down"
        elif kind in _STARTING:
            # A restart while stepping with no failure before it: a node joined, the group re-forms.
            result.seconds["startup" if mode == "stepping" else _phase_bucket(mode)] += gap
            if mode not in ("down", "rollback"):
                mode = "startup"
        elif kind in _QUEUED:
            result.seconds["other" if mode == "stepping" else _phase_bucket(mode)] += gap
            mode = "queued"
        elif kind in _ENDED:
            final = "checkpoint" if saved else "other"
            result.seconds[final if mode == "stepping" else _phase_bucket(mode)] += gap
            mode = "ended"
        else:
            continue  # a point inside a phase (a resume, a skipped step, a status) ends none
        cursor = time
    _split_steps(result, spent)
    return result


def ledger_of(rows: Iterable[tuple[str, datetime, dict[str, Any]]]) -> Ledger:
    """The ledger of stored events, as (kind, time, data) rows of RunEvent in seq order."""
    return ledger((kind, time.timestamp(), data) for kind, time, data in rows)


def _phase_bucket(mode: str) -> str:
    return {"queued": "queued", "startup": "startup", "down": "down", "rollback": "rolled_back"}.get(mode, "other")


def _split_steps(result: Ledger, spent: list[_Step]) -> None:
    """Each step's gap: up to the run's median step it is the step, the rest of a gap with a save
    or an evaluation in it is that stall. A step a rollback abandoned was spent for nothing."""
    median = statistics.median(r.seconds for r in spent) if spent else 0.0
    for record in spent:
        if record.abandoned:
            result.seconds["rolled_back"] += record.seconds
            continue
        stall = max(0.0, record.seconds - median) if record.saved or record.evaluated else 0.0
        result.seconds["replayed" if record.replayed else "productive"] += record.seconds - stall
        if stall:
            result.seconds["checkpoint" if record.saved else "evaluation"] += stall
