"""The node agent's rank processes: started so they cannot outlive it, logged, stopped as a group.

Two facts about process lifetime drive this module:

* If the agent is SIGKILLed, nobody is left to stop its ranks; they keep training and the other
  nodes wait on them. Each rank therefore asks the kernel for SIGKILL when its parent dies
  (`PR_SET_PDEATHSIG`). The request is made by a tiny trampoline that then `exec`s the real
  command (the setting survives `exec`), because doing it in `preexec_fn` is unsafe in a parent
  that runs threads (the reporter, the rendezvous keep-alive).
* A rank may start helpers of its own. Each rank leads its own process group, so one `killpg`
  stops the rank and everything it started.

A restart can also take a warm standby (`training.agent.standby`): a process started the same way that
has already imported the trainer, and becomes rank R when handed its environment.

stdout and stderr of rank R are appended to its rank log (`RunDir.rank_log`), across restarts, so the
stack a hung rank dumps before it is killed stays next to what the restarted rank prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# Runs in the child before the real command: die with the parent, and give up at once if the
# parent already died between fork and prctl (then nobody would ever send the signal).
_TRAMPOLINE = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG = 1, SIGKILL = 9\n"
    "if os.getppid() != int(sys.argv[1]): os._exit(70)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


@dataclass(kw_only=True, frozen=True)
class RankSlot:
    """Who a rank is and where it writes: decided by the agent after each rendezvous."""

    global_rank: int
    local_rank: int
    env: dict[str, str]
    log: Path  # stdout and stderr, appended
    heartbeat_file: Path
    error_file: Path  # where the rank reports an error no restart can cure (training.rank_environment.RankError)
    cores: frozenset[int] | None = None  # the cores of its CPU slot on a host; None: the agent's own


def pin(pid: int, cores: frozenset[int] | None) -> None:
    """Runs every thread of `pid` on `cores` (threads started later inherit it). A standby has
    threads already (torch is imported), so each of them is pinned, not only the process."""
    if not cores:
        return
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except FileNotFoundError:
        return
    for thread in threads:
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(thread, cores)


@dataclass(kw_only=True)
class RankProcess:
    global_rank: int
    local_rank: int
    popen: subprocess.Popen[bytes]
    heartbeat_file: Path
    error_file: Path
    started_at: float  # time.time() at spawn
    log: Path
    exit_code: int | None = field(default=None)
    # A descriptor that becomes readable the moment the process exits, so the agent wakes up at
    # once instead of at its next poll; None where the kernel has no pidfd_open (Linux < 5.3).
    pidfd: int | None = field(default=None)

    def __post_init__(self) -> None:
        try:
            self.pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):  # no pidfd on this kernel, or the process is gone
            self.pidfd = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def close_pidfd(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def poll(self) -> int | None:
        if self.exit_code is None:
            self.exit_code = self.popen.poll()
        return self.exit_code

    def signal(self, sig: signal.Signals) -> None:
        """Sends `sig` to the rank's whole process group; a group already gone is fine."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass(kw_only=True)
class Standby:
    """A process that has imported the rank's entry point and waits for its orders on stdin."""

    popen: subprocess.Popen[bytes]

    def alive(self) -> bool:
        return self.popen.poll() is None

    def discard(self) -> None:
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()


def _start_log(log: Path, global_rank: int, how: str) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        out.write(
            f"\n===== fathom: rank {global_rank} starting ({how}) at {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n".encode()
        )


def spawn_standby(entrypoint: str, *, env: dict[str, str], log: Path) -> Standby:
    """Starts a standby; until it becomes a rank, what it prints goes to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), sys.executable, "-m", "training.agent.standby", entrypoint],
            env=env,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Standby(popen=popen)


def activate_standby(standby: Standby, argv: list[str], slot: RankSlot) -> RankProcess | None:
    """Turns `standby` into the rank of `slot`; None if it died before it could take the order."""
    if not standby.alive() or standby.popen.stdin is None:
        return None
    _forget_previous_attempt(slot)
    _start_log(slot.log, slot.global_rank, "warm standby")
    pin(standby.popen.pid, slot.cores)
    order = {"env": slot.env, "argv": argv, "log": str(slot.log)}
    try:
        standby.popen.stdin.write(json.dumps(order).encode() + b"\n")
        standby.popen.stdin.close()
    except BrokenPipeError:
        standby.discard()
        return None
    return _rank_process(slot, standby.popen)


def spawn_rank(command: list[str], slot: RankSlot) -> RankProcess:
    """Starts the rank of `slot` from scratch: `command` is the full argv (python -m …)."""
    _forget_previous_attempt(slot)
    _start_log(slot.log, slot.global_rank, "cold")
    with open(slot.log, "ab") as out:
        popen = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(os.getpid()), *command],
            env=slot.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    pin(popen.pid, slot.cores)
    return _rank_process(slot, popen)


def _forget_previous_attempt(slot: RankSlot) -> None:
    """A beat or an error report left by the previous attempt is not this rank's."""
    slot.heartbeat_file.unlink(missing_ok=True)
    slot.error_file.unlink(missing_ok=True)


def _rank_process(slot: RankSlot, popen: subprocess.Popen[bytes]) -> RankProcess:
    return RankProcess(
        global_rank=slot.global_rank,
        local_rank=slot.local_rank,
        popen=popen,
        heartbeat_file=slot.heartbeat_file,
        error_file=slot.error_file,
        started_at=time.time(),
        log=slot.log,
    )


def stop_ranks(ranks: list[RankProcess], *, sig: signal.Signals | None, grace: float) -> None:
    """Sends `sig` to every rank (None: no signal, they are exiting on their own), waits up to
    `grace` seconds, then SIGKILLs what is left."""
    live = [r for r in ranks if r.poll() is None]
    if sig is not None:
        for rank in live:
            rank.signal(sig)
            if sig != signal.SIGKILL:
                rank.signal(signal.SIGCONT)  # a stopped process only acts on SIGTERM once continued
    deadline = time.monotonic() + grace
    for rank in live:
        try:
            rank.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for rank in ranks:
        # Also for ranks that exited themselves: helpers left in their group go too.
        rank.signal(signal.SIGKILL)
    for rank in ranks:
        rank.popen.wait()
        rank.poll()
        rank.close_pidfd()


def wait_for_exit(ranks: list[RankProcess], timeout: float) -> None:
    """Sleeps up to `timeout` seconds, waking early when a running rank exits."""
    pidfds = [r.pidfd for r in ranks if r.pidfd is not None and r.exit_code is None]
    if pidfds:
        select.select(pidfds, [], [], timeout)
    else:
        time.sleep(timeout)
