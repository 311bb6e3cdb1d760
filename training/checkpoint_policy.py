"""When a run checkpoints: every `train.checkpoint_interval` steps, or, at 0 (the default), by
Young's rule from what this run measures.

A failure loses the work since the last checkpoint (half an interval on average), and every
checkpoint costs the training loop C seconds; with a failure every M seconds, the interval that
loses least in all is τ = √(2·C·M) (J. W. Young, 1974). A fixed number of steps cannot be that:
the same spec steps 5× slower on a busy host, and a save costs more on a larger model. So:

* C is measured: the wall time of the step that followed a save, beyond the median step (what
  the save, or its background copy, took from the loop);
* M is the run's own: until its first restart `MTBF_PRIOR_S`; then the training time per
  restart so far (steps done × median step time ÷ restarts), which a run failing every minute
  learns within a few failures and a healthy run never lowers.

Saves are collective, so every rank must pick the same steps: the next interval is agreed once
per save, by one all-reduce (max) of every rank's figures at the step after it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

import torch
import torch.distributed as dist

from training.collectives import agreed
from training.config import RunSpec
from training.rank_environment import RankEnvironment

CPU = torch.device("cpu")

# The failure rate assumed until the run has seen one: an hourly failure is the planning figure
# of large jobs (Llama 3 405B: one interruption every ~3 h on 16k GPUs); smaller jobs fail less,
# and with background saves an interval chosen too short costs only C per save.
MTBF_PRIOR_S = 3600.0
# Steps before the first save of an attempt: enough to know the step time, and the first save
# measures C.
FIRST_INTERVAL_STEPS = 10
# However rare failures are, a run keeps at most this much work at risk.
MAX_INTERVAL_S = 3600.0
# Step times remembered for the median (a restart's slow first steps age out).
_WINDOW = 64


class CheckpointPolicy:
    """`due(step)` is called on every rank after each step; True: save now."""

    def __init__(
        self,
        *,
        interval: int,
        total_steps: int,
        first_step: int,
        attempt: int,
        distributed: bool,
        memory_snapshots: bool = False,
        device: torch.device = CPU,
    ) -> None:
        self.interval = interval  # train.checkpoint_interval; 0: Young's rule
        self.total_steps = total_steps
        # Restarts of the job so far (FATHOM_ATTEMPT). Where ranks resume from in-memory snapshots,
        # a rank's failure costs the disk nothing: only a lost host does, so M stays the prior.
        self.attempt = 0 if memory_snapshots else attempt
        self.distributed = distributed
        self.device = device  # where the ranks agree on C and M: the rank's compute device
        self.next_step = first_step + FIRST_INTERVAL_STEPS
        self.save_cost: float | None = None  # C, agreed over the ranks, seconds
        self.young_interval: float | None = None  # τ, seconds
        self._step_times: deque[float] = deque(maxlen=_WINDOW)
        self._last: float | None = None
        self._saved_step: int | None = None

    @classmethod
    def for_run(
        cls, spec: RunSpec, *, first_step: int, distributed: bool, memory_snapshots: bool = False,
        device: torch.device = CPU,
    ) -> CheckpointPolicy:  # fmt: skip
        """The policy of `spec`, for an attempt that resumed at `first_step`."""
        env = RankEnvironment.from_environ()
        return cls(
            interval=spec.train.checkpoint_interval,
            total_steps=spec.train.steps,
            first_step=first_step,
            attempt=env.attempt if env is not None else 0,
            distributed=distributed,
            memory_snapshots=memory_snapshots,
            device=device,
        )

    def state_dict(self) -> dict[str, Any]:
        """The plan, kept in each in-memory snapshot so that a rank resumed from one carries on with
        it instead of measuring the save cost anew (a save FIRST_INTERVAL_STEPS into every attempt)."""
        return {"next_step": self.next_step, "save_cost": self.save_cost, "young_interval": self.young_interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.next_step = int(state["next_step"])
        self.save_cost = state["save_cost"]
        self.young_interval = state["young_interval"]

    def restart_clock(self) -> None:
        """The next `due` measures no gap: the time since the last one went to a guard's rollback,
        which is neither a step's nor a save's."""
        self._last = None

    def due(self, step: int) -> bool:
        now = time.perf_counter()
        if self._last is not None:
            gap = now - self._last
            if self._saved_step == step - 1 and self._step_times:
                self._plan(step, extra=max(0.0, gap - statistics.median(self._step_times)))
            else:
                self._step_times.append(gap)
        self._last = now
        if step == self.total_steps:
            return True
        if self.interval:
            return step % self.interval == 0
        if step >= self.next_step:
            self._saved_step = step
            return True
        return False

    def _plan(self, step: int, extra: float) -> None:
        """Sets the next save's step from C (this save's cost) and M; same result on every rank."""
        self.save_cost, self.young_interval, steps = young_interval(
            extra, statistics.median(self._step_times), step=step, failures=self.attempt, distributed=self.distributed,
            device=self.device,
        )  # fmt: skip
        self.next_step = step - 1 + steps
        self._saved_step = None


def young_interval(
    cost: float, step_s: float, *, step: int, failures: int, distributed: bool, least_cost: float = 1e-4,
    device: torch.device = CPU,
) -> tuple[float, float, int]:  # fmt: skip
    """(C, τ in seconds, τ in steps) by Young's rule, from this rank's cost C of one save, its median
    step time and the failures it counts, each the largest over the ranks (one all-reduce), so every
    rank gets the same answer.

    M is MTBF_PRIOR_S until the first of the `failures` counted, then the training time per failure so far.
    """
    figures = [cost, step_s, failures]
    if distributed:
        figures = agreed(figures, dist.ReduceOp.MAX, device=device)
    cost, step_s, failures = float(figures[0]), max(float(figures[1]), 1e-6), int(figures[2])
    mtbf = MTBF_PRIOR_S if failures == 0 else step * step_s / failures
    # A cost measured as nothing (a background save that overlapped a step entirely) is not free.
    tau = min(MAX_INTERVAL_S, math.sqrt(2 * max(cost, least_cost) * mtbf))
    return cost, tau, max(1, round(tau / step_s))


# Steps before an attempt's first in-memory snapshot: enough for a step time to compare its cost with.
FIRST_SNAPSHOT_STEPS = 2
# The snapshot of an attempt whose cost is a measure: the first that writes into a slot (of
# training.memory_snapshot's two) already written by this process.
WARM_SNAPSHOT = 3


class SnapshotPolicy:
    """When a rank copies its state into shared memory (`training.memory_snapshot`).

    The same rule as the disk's, with the snapshot's own cost: every k steps, k from Young's
    τ = √(2·C·M), where C is what the attempt's third snapshot took (the slowest rank's) and M
    the interval between the failures these snapshots must cover: the run's training time per
    restart that did not resume from a snapshot taken at the failure (`Trainer._snapshot_at_failure`:
    a rank killed under plain data parallelism costs no replay whatever the interval), the prior
    until there is one. The first two are taken on consecutive steps
    and not measured: each is the first copy into one of the two slots in this process, which
    faults the slot's pages in (measured at 2-3× the copy itself, `tiny`), and an interval from
    that would be √2-√3 too long. Agreed once per attempt by one all-reduce, so every rank
    snapshots the same steps.
    """

    def __init__(self, *, first_step: int, failures: int, distributed: bool, device: torch.device = CPU) -> None:
        self.failures = failures  # restarts so far that snapshots taken at the failure did not cover
        self.distributed = distributed
        self.device = device
        self.first = first_step + FIRST_SNAPSHOT_STEPS
        self.measured = self.first + WARM_SNAPSHOT - 1  # the snapshot whose cost sets the interval
        self.every: int | None = None  # steps between snapshots, once agreed
        self._step_times: list[float] = []
        self._last: float | None = None
        self.cost: float | None = None

    def restart_clock(self) -> None:
        """As CheckpointPolicy.restart_clock: a rollback's time is not a step's."""
        self._last = None

    def due(self, step: int) -> bool:
        now = time.perf_counter()
        if self._last is not None and self.every is None:
            self._step_times.append(now - self._last)
        self._last = now
        if self.every is None:
            return self.first <= step <= self.measured
        return (step - self.measured) % self.every == 0

    def taken(self, step: int, seconds: float) -> None:
        """Called after the snapshot of `step` with its duration; the third one sets the interval."""
        if self.every is not None or step != self.measured:
            return
        step_s = statistics.median(self._step_times) if self._step_times else seconds
        self.cost, _, self.every = young_interval(
            seconds, step_s, step=step, failures=self.failures, distributed=self.distributed, least_cost=1e-5,
            device=self.device,
        )  # fmt: skip
