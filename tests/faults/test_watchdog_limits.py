"""How long the watchdog lets a live rank stay silent, by the phase of its last beat: a real
process (it only sleeps) and beats written as a rank writes them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from training.agent.rank_processes import RankProcess
from training.agent.watchdog import Watchdog, WatchdogConfig


@pytest.fixture
def rank(tmp_path: Path) -> Iterator[RankProcess]:
    popen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    process = RankProcess(
        global_rank=0, local_rank=0, popen=popen, heartbeat_file=tmp_path / "beat.json",
        error_file=tmp_path / "error.json", started_at=time.time(), log=tmp_path / "rank.log",
    )  # fmt: skip
    yield process
    popen.kill()
    popen.wait()
    process.close_pidfd()


def beat(rank: RankProcess, phase: str, silent_for: float) -> None:
    data = {"rank": 0, "pid": os.getpid(), "step": 0 if phase == "starting" else 3, "phase": phase}
    rank.heartbeat_file.write_text(json.dumps({**data, "time": time.time() - silent_for}))


def test_a_starting_rank_gets_the_starting_grace_and_a_training_one_only_the_heartbeat_timeout(rank):
    watchdog = Watchdog(WatchdogConfig(heartbeat_timeout=2.0, starting_timeout=15.0))
    # Silent 5 s while starting (lazy imports, a checkpoint read holding the GIL): not hung.
    beat(rank, "starting", silent_for=5.0)
    assert watchdog.check([rank]).failures == []
    beat(rank, "starting", silent_for=16.0)
    (failure,) = watchdog.check([rank]).failures
    assert (failure.reason, failure.last_phase) == ("hung", "starting")
    # Once it trains, the heartbeat timeout alone applies.
    for phase in ("step", "between_steps", "checkpoint"):
        beat(rank, phase, silent_for=2.5)
        (failure,) = watchdog.check([rank]).failures
        assert (failure.reason, failure.last_phase) == ("hung", phase)
    beat(rank, "step", silent_for=1.0)
    assert watchdog.check([rank]).failures == []
