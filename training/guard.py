"""The guard's judgement of each step's loss (spec.guard): a spike, and where a rollback goes.

Pure bookkeeping, the same on every rank: each rank reads the step's loss from the all-reduce
that every rank shares (the trainer's riders), so each judges the same numbers in the same
order and all agree without a collective of their own. The trainer acts on the verdicts
(training/trainer.py): it skips a non-finite step, and rolls every rank back for a spike.

A spike is a loss more than `spike_zscore` standard deviations above the mean of the `window`
steps before it. The deviation is floored at 1 % of the mean: on a plateau the step-to-step
noise can be tiny, and a blip of a few hundredths would otherwise count as a spike. Skipped and
rolled-back steps' losses never enter the window, so one spike does not hide the next.

A rollback goes to the newest state saved before the spike. A spike again within `window` steps
of that state says the state was already on its way up (an instability that grew for steps
before the loss showed it), so the next rollback goes to a state older than it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from training.config import GuardConfig

# The deviation a spike is measured in is at least this share of the window's mean loss.
STDEV_FLOOR = 0.01


@dataclass(frozen=True)
class Spike:
    step: int
    loss: float
    mean: float
    stdev: float  # floored

    @property
    def zscore(self) -> float:
        return (self.loss - self.mean) / self.stdev

    def describe(self) -> str:
        return (
            f"loss spike at step {self.step}: {self.loss:.4g} is {self.zscore:.1f} standard deviations above "
            f"the mean of the steps before it ({self.mean:.4g} ± {self.stdev:.2g})"
        )


class LossGuard:
    """A rank's view of the run's recent losses and of the rollbacks so far."""

    def __init__(self, config: GuardConfig) -> None:
        self.config = config
        self.losses: deque[float] = deque(maxlen=config.window)
        self.rollbacks = 0
        self.last_target: int | None = None  # the step the last rollback went back to

    @property
    def watches_spikes(self) -> bool:
        return self.config.spike_zscore > 0

    def judge(self, step: int, loss: float) -> Spike | None:
        """The spike `loss` at `step` is, if it is one; otherwise the loss joins the window."""
        if self.watches_spikes and len(self.losses) == self.losses.maxlen and math.isfinite(loss):
            # math.fsum, not statistics.pstdev: its exact fractions cost ~0.2 ms a step on 100 losses.
            mean = math.fsum(self.losses) / len(self.losses)
            spread = math.sqrt(math.fsum((x - mean) ** 2 for x in self.losses) / len(self.losses))
            stdev = max(spread, STDEV_FLOOR * abs(mean))
            if loss > mean + self.config.spike_zscore * stdev:
                return Spike(step=step, loss=loss, mean=mean, stdev=stdev)
        if math.isfinite(loss):
            self.losses.append(loss)
        return None

    def rollback_before(self, step: int) -> int:
        """The rollback for trouble at `step` goes to a saved state older than this step."""
        if self.last_target is not None and step - self.last_target <= self.config.window:
            return min(step, self.last_target)  # the last rollback's state did not cure it
        return step

    def skipped_batches(self, trouble_step: int, target_step: int) -> int:
        """Batches skipped after rolling back from `trouble_step` to `target_step`: those from the
        target to the trouble (which led to it) and at least `rollback_skip_batches`."""
        return max(self.config.rollback_skip_batches, trouble_step - target_step)

    def rolled_back(self, target_step: int, saved: dict[str, Any] | None) -> None:
        """Takes the window of the state rolled back to; the rollbacks counted so far stay."""
        self.losses = deque((saved or {}).get("losses", []), maxlen=self.config.window)
        self.last_target = target_step

    def state_dict(self) -> dict[str, Any]:
        """Kept in each checkpoint and snapshot, so a resumed run judges as the uninterrupted one."""
        return {"losses": list(self.losses), "rollbacks": self.rollbacks, "last_target": self.last_target}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A resume's: the saved window and rollbacks (a checkpoint from before the guard has none)."""
        state = state or {}
        self.losses = deque(state.get("losses", []), maxlen=self.config.window)
        self.rollbacks = int(state.get("rollbacks", 0))
        self.last_target = state.get("last_target")
