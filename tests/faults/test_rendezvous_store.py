"""The standalone rendezvous store stays while any agent of its run holds its lock, then leaves."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.faults.harness import ROOT, free_port, wait_for
from training.agent.rendezvous_store import held_flocks


def test_held_flocks_reads_proc_locks_and_skips_waiters() -> None:
    text = (
        "1: FLOCK  ADVISORY  WRITE 23678 fe:00:2146486 0 EOF\n"
        "1: -> FLOCK  ADVISORY  WRITE 23700 fe:00:2146486 0 EOF\n"
        "2: POSIX  ADVISORY  READ 23607 fe:00:2215515 128 128\n"
    )
    assert held_flocks(text) == {(254, 0, 2146486)}


def test_the_store_lives_while_an_agent_holds_its_lock_and_leaves_after(tmp_path: Path) -> None:
    lock = tmp_path / "agent-node0.lock"
    lock.touch()
    # Stands in for an agent under the launcher's flock: holds the lock until its stdin closes.
    agent = subprocess.Popen(["flock", "-n", str(lock), "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    endpoint = f"127.0.0.1:{free_port()}"
    store = subprocess.Popen(
        [sys.executable, "-m", "training.agent.rendezvous_store", "--endpoint", endpoint, "--run-dir", str(tmp_path),
         "--start-grace-s", "60", "--idle-exit-s", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert store.stdout is not None and agent.stdin is not None
        assert f"listening on {endpoint}" in store.stdout.readline()
        time.sleep(3)  # several of its checks, each finding the lock held
        assert store.poll() is None
        agent.stdin.close()
        agent.wait()
        released = time.monotonic()
        wait_for(lambda: store.poll() is not None, 60, "the store to leave")
        # Within its idle time of the release, not at the end of its 60 s start grace.
        assert store.returncode == 0 and time.monotonic() - released < 10
        assert "no agent of the run is left" in store.stdout.read()
    finally:
        store.kill()
        agent.kill()
