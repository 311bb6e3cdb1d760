"""Failures injected on purpose (`spec.faults`), so that recovery is tested on the real path.

Each `FaultSpec` fires inside a rank, from the training hooks, at a chosen step:

| kind                     | fires in                             | at                          | does                     |
|--------------------------|--------------------------------------|-----------------------------|--------------------------|
| `kill_rank`              | global rank `rank`                   | start of step `step`        | SIGKILL itself           |
| `crash_rank`             | global rank `rank`                   | start of step `step`        | SIGSEGV itself: a crash in native code, whose stacks faulthandler prints to the rank's log |
| `hang_rank`              | global rank `rank`                   | start of step `step`        | SIGSTOP itself (frozen)  |
| `kill_during_checkpoint` | global rank `rank`                   | the commit of step `step`   | SIGKILL itself, after its shards are written and before the commit |
| `slow_checkpoint`        | global rank `rank`                   | the commit of step `step`   | waits 5 s there: a save still being written (e.g. when a cancel arrives) |
| `slow_steps`             | global rank `rank`                   | start of every step ≥ `step` | waits 0.2 s: a slower host, so a run outlasts a time limit however fast this one is |
| `kill_agent`             | local rank 0 on node `node`          | start of step `step`        | SIGKILL its node agent   |
| `nonfinite_grad`         | global rank `rank`                   | step `step`, after backward | sets one of its gradients to NaN: a corrupt batch or an overflow, for the guard (`guard.nonfinite`) |
| `corrupt_weights`        | global rank `rank`                   | start of step `step`        | multiplies its weights by 8: silent data corruption, whose loss spikes at once (`guard.spike_zscore`) |

`once` faults fire at most once per run, not once per process: a resumed run replays the steps
after its checkpoint and would otherwise meet the same fault again, forever. Before firing, the
rank claims a marker file in the run folder (`RunDir.fault_marker`) with O_EXCL (named by
content, not position, so a spec resized for a smaller world keeps its markers); whoever finds the marker
already there does nothing. A marker in the run folder (rather than the restart count) is also
right when a killed node's agent is started again from scratch, and lets several `once` faults
fire one after another in the same run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from training.config import FaultSpec
from training.run_dir import RunDir

CHECKPOINT_FAULTS = ("kill_during_checkpoint", "slow_checkpoint")
# Faults fired where the step's gradients are whole, not at its start.
GRADIENT_FAULTS = ("nonfinite_grad",)
SLOW_CHECKPOINT_SECONDS = 5.0
SLOW_STEP_SECONDS = 0.2
CORRUPTION_FACTOR = 8.0


class FaultHook:
    """TrainHook that fires the faults of `faults` that belong to this rank."""

    def __init__(
        self, faults: list[FaultSpec], *, rank: int, local_rank: int, node_rank: int, run_dir: RunDir
    ) -> None:
        self._run_dir = run_dir
        self._mine: list[FaultSpec] = [
            f
            for f in faults
            if (f.kind == "kill_agent" and f.node == node_rank and local_rank == 0)
            or (f.kind != "kill_agent" and f.rank == rank)
        ]

    def on_step_start(self, step: int, params: list[Any]) -> None:
        for fault in self._mine:
            if fault.kind == "slow_steps":
                if step >= fault.step:
                    time.sleep(SLOW_STEP_SECONDS)  # every step, on every attempt: the host is slow
            elif fault.kind == "corrupt_weights":
                if fault.step == step and self._claim(fault):
                    print(f"fathom: injecting fault {fault.kind} at step {fault.step}", flush=True)
                    with torch.no_grad():
                        for param in params:  # this rank's shard of each (DTensor or not)
                            (param.to_local() if hasattr(param, "to_local") else param).mul_(CORRUPTION_FACTOR)
            elif fault.kind not in (*CHECKPOINT_FAULTS, *GRADIENT_FAULTS) and fault.step == step and self._claim(fault):
                _fire(fault)

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def after_backward(self, step: int, params: list[Any]) -> None:
        for fault in self._mine:
            if fault.kind in GRADIENT_FAULTS and fault.step == step and self._claim(fault):
                print(f"fathom: injecting fault {fault.kind} at step {fault.step}", flush=True)
                grad = next(p.grad for p in params if p.grad is not None)
                # A DTensor's (TP, FSDP) local shard: NaN on this rank's part only, as a bad
                # kernel or batch would make it.
                (grad.to_local() if hasattr(grad, "to_local") else grad).fill_(float("nan"))

    def before_checkpoint_commit(self, step: int, staging_dir: Path | str) -> None:
        for fault in self._mine:
            if fault.kind in CHECKPOINT_FAULTS and fault.step == step and self._claim(fault):
                _fire(fault)

    def close(self) -> None:
        pass

    def _claim(self, fault: FaultSpec) -> bool:
        if not fault.once:
            return True
        marker = self._run_dir.fault_marker(fault.kind, rank=fault.rank, node=fault.node, step=fault.step)
        marker.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        # When it fired, for whoever measures detection; on disk before the process dies, or
        # the resumed run would fire it again.
        os.write(fd, json.dumps({"time": time.time(), "pid": os.getpid()}).encode())
        os.fsync(fd)
        os.close(fd)
        return True


def _fire(fault: FaultSpec) -> None:
    print(f"fathom: injecting fault {fault.kind} at step {fault.step}", flush=True)
    if fault.kind == "kill_agent":
        # The agent is this rank's parent; its death takes every rank of the node with it
        # (PR_SET_PDEATHSIG), which is what losing a host looks like to the other nodes.
        os.kill(os.getppid(), signal.SIGKILL)
        signal.pause()
    elif fault.kind == "crash_rank":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif fault.kind == "hang_rank":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif fault.kind == "slow_checkpoint":
        time.sleep(SLOW_CHECKPOINT_SECONDS)
    else:
        os.kill(os.getpid(), signal.SIGKILL)
