"""The rendezvous store of a multi-node run, in a process of its own.

torch's c10d rendezvous keeps the job's membership in a TCPStore that, by default, the agent of
node 0 hosts: losing that agent then ends the job on every node, whatever `nodes.min` says. For a
run with more than one node the launcher starts this process first and has every agent connect to
it (`--host-store no`): on the control plane's machine for a run on hosts, so that any host of the
run, node 0's included, may be lost; on the first node for a Slurm job. (The ranks' own store is
not affected: each rendezvous round's rank-0 agent hosts it anew.)

    python -m training.agent.rendezvous_store --endpoint HOST:PORT --run-dir DIR [--run-id ID]

It leaves when the run's agents are gone: once, for IDLE_EXIT_S, no agent lock of the run folder
is held on this machine (the launcher starts each agent under flock on it) and the run's
rendezvous state has not changed (every agent, wherever it runs, writes its keep-alive there each
second while it lives: torch's dynamic rendezvous). The locks are read from /proc/locks, never
taken: a relaunched agent must not find its lock held by this process.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from training.run_dir import RunDir

if TYPE_CHECKING:
    from torch.distributed import Store

# Agents import torch before they first connect, which takes a while on a busy machine.
START_GRACE_S = 120.0
# How long the store waits after the last agent left: a relaunch (reconcile re-sending a lost
# launch) takes a few seconds to start again.
IDLE_EXIT_S = 30.0
# What a client may wait for a key; the rendezvous sets its own, shorter deadlines.
STORE_TIMEOUT = timedelta(minutes=30)

FileId = tuple[int, int, int]  # device major, device minor, inode


def held_flocks(proc_locks: str | None = None) -> set[FileId]:
    """Files that some process holds a flock on, from the text of /proc/locks."""
    text = Path("/proc/locks").read_text() if proc_locks is None else proc_locks
    held = set()
    for line in text.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2146486 0 EOF"; a waiter's line carries "->".
        fields = line.split()
        if len(fields) >= 6 and fields[1] == "FLOCK" and "->" not in fields:
            major, minor, inode = fields[5].split(":")
            held.add((int(major, 16), int(minor, 16), int(inode)))
    return held


def agents_running(run_dir: Path) -> bool:
    held = held_flocks()
    for lock in RunDir(run_dir).agent_locks():
        try:
            st = lock.stat()
        except FileNotFoundError:
            continue
        if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in held:
            return True
    return False


class RendezvousState:
    """The run's rendezvous state as the store holds it (c10d's backend key), read through the
    store's own client: `changed()` says whether an agent wrote it since the last look."""

    def __init__(self, store: Store, run_id: str) -> None:
        self.store = store
        self.key = "torch.rendezvous." + run_id  # torch's C10dRendezvousBackend
        self.last: bytes | None = None

    def changed(self) -> bool:
        if not self.store.check([self.key]):
            return False
        value = self.store.get(self.key)
        changed, self.last = value != self.last, value
        return changed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training.agent.rendezvous_store", description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", required=True, help="HOST:PORT the agents are given as --rdzv-endpoint")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--run-id", help="the agents' run id; default: the run folder's name, as theirs")
    parser.add_argument("--start-grace-s", type=float, default=START_GRACE_S, help="for the first agent to appear")
    parser.add_argument("--idle-exit-s", type=float, default=IDLE_EXIT_S, help="after the last agent left")
    args = parser.parse_args(argv)
    port = int(args.endpoint.rsplit(":", 1)[1])

    from torch.distributed import TCPStore

    # The server listens on every address of the machine, the endpoint's among them; its own
    # client, which watches the state, goes over loopback: an address taken off the machine
    # (a network going down) would leave it waiting for STORE_TIMEOUT.
    store = TCPStore(
        "127.0.0.1", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=STORE_TIMEOUT
    )
    print(f"rendezvous store listening on {args.endpoint}", flush=True)
    state = RendezvousState(store, args.run_id or args.run_dir.name)
    deadline = time.monotonic() + args.start_grace_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, args.idle_exit_s / 2))
        if state.changed() or agents_running(args.run_dir):
            deadline = time.monotonic() + args.idle_exit_s
    print("no agent of the run is left: the store closes", flush=True)
    del store


if __name__ == "__main__":
    main()
