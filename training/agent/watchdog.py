"""Decides, from exit codes and heartbeats, whether a node's ranks are running, done or failed.

The agent calls `Watchdog.check` every `monitor_interval` (250 ms) and as soon as a rank exits (its
pidfd wakes the agent): an exit is noticed at once; a hang within `heartbeat_timeout` plus one
interval. The watchdog only judges; the agent
acts (dumps stacks, kills the group, restarts).
"""

from __future__ import annotations

import signal
import socket
import time
from dataclasses import dataclass
from typing import Literal

from training.agent.rank_processes import RankProcess
from training.heartbeat import Beat, read_beat
from training.rank_environment import SAVED_AND_STOPPED_EXIT

FailureReason = Literal["exited", "killed by signal", "hung"]


@dataclass(kw_only=True, frozen=True)
class WatchdogConfig:
    heartbeat_timeout: float  # spec.nodes.heartbeat_timeout: a live rank silent this long is hung
    # Before its first beat a rank imports torch, joins the process group and loads the newest
    # checkpoint; on a large model from network storage that takes minutes, so it gets longer.
    startup_timeout: float = 600.0
    # After its first beat a starting rank still imports lazily (a storage client and the service
    # models it parses on first use) and reads its checkpoint: one C call can hold the GIL, and so
    # silence the beat thread, for seconds on a busy host. Until its first step it is judged by
    # at least this (seen: 2.2 s of silence in an S3 resume on a 2-core host at load 10).
    starting_timeout: float = 15.0
    # After `close()` the beat stops while the rank tears down its process group and exits; a rank
    # still there after this long is stuck in shutdown.
    exit_timeout: float = 60.0


@dataclass(kw_only=True, frozen=True)
class RankFailure:
    rank: int
    local_rank: int
    host: str
    pid: int
    reason: FailureReason
    exit_code: int | None  # the process's exit status; None when it was hung
    signal: str | None  # e.g. "SIGKILL" when killed by a signal
    last_step: int | None  # from its last heartbeat
    last_phase: str | None
    silent_for: float | None  # seconds since its last heartbeat, when hung
    detected_at: float  # time.time()

    def as_event(self) -> dict[str, object]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": self.pid,
            "reason": self.reason,
            "exit_code": self.exit_code,
            "signal": self.signal,
            "last_step": self.last_step,
            "last_phase": self.last_phase,
            "silent_for": self.silent_for,
        }


@dataclass(kw_only=True, frozen=True)
class GroupState:
    failures: list[RankFailure]
    succeeded: bool  # every rank exited with status 0
    # Every rank checkpointed and exited because the scheduler asked (SAVED_AND_STOPPED_EXIT);
    # one that exited so while the others still finish is no failure.
    saved_and_stopped: bool = False


class Watchdog:
    def __init__(self, config: WatchdogConfig) -> None:
        self._config = config
        self._host = socket.gethostname()

    def check(self, ranks: list[RankProcess]) -> GroupState:
        now = time.time()
        failures: list[RankFailure] = []
        for rank in ranks:
            code = rank.poll()
            beat = read_beat(rank.heartbeat_file)
            if code is not None:
                if code not in (0, SAVED_AND_STOPPED_EXIT):
                    failures.append(self._failure(rank, beat, now, code=code))
                continue
            if beat is None:
                silent_for = now - rank.started_at
                limit = self._config.startup_timeout
            else:
                silent_for = beat.age(now)
                limit = {
                    "done": self._config.exit_timeout,
                    "starting": max(self._config.heartbeat_timeout, self._config.starting_timeout),
                }.get(beat.phase, self._config.heartbeat_timeout)
            if silent_for > limit:
                failures.append(self._failure(rank, beat, now, silent_for=silent_for))
        codes = [r.poll() for r in ranks]
        succeeded = not failures and all(c == 0 for c in codes)
        stopped = not failures and SAVED_AND_STOPPED_EXIT in codes and all(c is not None for c in codes)
        return GroupState(failures=failures, succeeded=succeeded, saved_and_stopped=stopped)

    def _failure(
        self,
        rank: RankProcess,
        last: Beat | None,
        now: float,
        *,
        code: int | None = None,
        silent_for: float | None = None,
    ) -> RankFailure:
        if code is None:
            reason: FailureReason = "hung"
            sig_name = None
        elif code < 0:
            reason, sig_name = "killed by signal", _signal_name(-code)
        else:
            reason, sig_name = "exited", None
        return RankFailure(
            rank=rank.global_rank,
            local_rank=rank.local_rank,
            host=self._host,
            pid=rank.pid,
            reason=reason,
            exit_code=code,
            signal=sig_name,
            last_step=last.step if last else None,
            last_phase=last.phase if last else None,
            silent_for=silent_for,
            detected_at=now,
        )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
