"""The standalone rendezvous store stays while any agent of its run holds its lock or keeps its
rendezvous alive, then leaves."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from tests.faults.harness import ROOT, free_port, wait_for
from training.agent.rendezvous_store import held_flocks


def start_store(endpoint: str, run_dir: Path, *args: str) -> subprocess.Popen:
    """The store with a 60 s start grace; its output readable line by line."""
    return subprocess.Popen(
        [sys.executable, "-m", "training.agent.rendezvous_store", "--endpoint", endpoint, "--run-dir", str(run_dir),
         "--start-grace-s", "60", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


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
    store = start_store(endpoint, tmp_path, "--idle-exit-s", "1")
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


# An agent on another machine, as far as the store can tell: torch's own c10d rendezvous, joined
# through the store and holding no lock the store can see; it leaves when its stdin closes.
REMOTE_AGENT = """
import sys
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

handler = get_rendezvous_handler(RendezvousParameters(
    backend="c10d", endpoint=sys.argv[1], run_id=sys.argv[2], min_nodes=1, max_nodes=1,
    is_host=False, keep_alive_interval=1, last_call_timeout=1,
))
handler.next_rendezvous()
print("joined", flush=True)
sys.stdin.read()
handler.shutdown()
"""


def test_the_store_lives_while_agents_elsewhere_keep_the_rendezvous_alive_and_leaves_after(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    store = start_store(endpoint, tmp_path, "--run-id", "run-7", "--idle-exit-s", "3")
    agent = None
    try:
        assert store.stdout is not None
        assert f"listening on {endpoint}" in store.stdout.readline()
        agent = subprocess.Popen(
            [sys.executable, "-c", REMOTE_AGENT, endpoint, "run-7"], cwd=ROOT, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert agent.stdout is not None and agent.stdin is not None
        assert agent.stdout.readline() == "joined\n"
        time.sleep(8)  # well past its idle time: only the agent's keep-alives hold it
        assert store.poll() is None
        agent.stdin.close()
        assert agent.wait(60) == 0
        left = time.monotonic()
        wait_for(lambda: store.poll() is not None, 60, "the store to leave")
        assert store.returncode == 0 and time.monotonic() - left < 15
        assert "no agent of the run is left" in store.stdout.read()
    finally:
        store.kill()
        if agent is not None:
            agent.kill()
