"""The guard's judgement of each step (spec.guard): a loss spike and where a rollback goes, and
which ranks straggle.

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


# Below this much (seconds) a rank's lag is noise, whatever its share of a tiny step.
STRAGGLER_MIN_LAG_S = 0.005


@dataclass(frozen=True)
class Straggler:
    """A rank that became a straggler (`slow`) or is back in line (not `slow`)."""

    rank: int
    slow: bool
    steps: int  # in a row, slow or back in line
    own_s: float  # its own time in the last of them
    others_s: float  # the median of the other ranks' then

    def as_event(self) -> dict[str, Any]:
        return {
            "rank": self.rank, "steps": self.steps, "own_s": round(self.own_s, 4), "others_s": round(self.others_s, 4),
            "slower_by": round(self.own_s / self.others_s, 2) if self.others_s > 0 else None,
        }  # fmt: skip


class StragglerWatch:
    """Rank 0's view of every rank's own time per step (each rank's rides the loss's all-reduce).

    A rank is slow in a step when its own time exceeds the median of its peers' by
    `straggler_margin` (and by STRAGGLER_MIN_LAG_S); `straggler_steps` slow steps in a row make it
    a straggler, as many in line end that. Its peers are the other ranks of its pipeline stage
    (`peers`: the stages' ranks; stages differ in their work, and a stage's backward waits for the
    next one's). The median of the others, not of all: with two ranks, the median of all lies
    halfway to the straggler and hides half its lag."""

    def __init__(self, config: GuardConfig, peers: list[list[int]]) -> None:
        self.margin = config.straggler_margin
        self.steps = config.straggler_steps
        self.peers = [group for group in peers if len(group) > 1]
        world_size = sum(len(group) for group in peers)
        self._slow_for = [0] * world_size
        self._fine_for = [0] * world_size
        self.stragglers: set[int] = set()

    @property
    def enabled(self) -> bool:
        return self.margin > 0 and bool(self.peers)

    def observe(self, times: list[float]) -> list[Straggler]:
        """The changes this step's times (seconds, by rank) make."""
        changes = []
        for group in self.peers:
            order = sorted(group, key=times.__getitem__)
            ranked = [times[r] for r in order]
            for position, rank in enumerate(order):
                others = _median_without(ranked, position)
                changes += self._judge(rank, times[rank], others)
        return sorted(changes, key=lambda c: c.rank)

    def _judge(self, rank: int, own: float, others: float) -> list[Straggler]:
        if own > others * (1 + self.margin) and own - others > STRAGGLER_MIN_LAG_S:
            self._slow_for[rank] += 1
            self._fine_for[rank] = 0
        else:
            self._fine_for[rank] += 1
            self._slow_for[rank] = 0
        if rank not in self.stragglers and self._slow_for[rank] >= self.steps:
            self.stragglers.add(rank)
            return [Straggler(rank=rank, slow=True, steps=self.steps, own_s=own, others_s=others)]
        if rank in self.stragglers and self._fine_for[rank] >= self.steps:
            self.stragglers.discard(rank)
            return [Straggler(rank=rank, slow=False, steps=self.steps, own_s=own, others_s=others)]
        return []


def _median_without(ranked: list[float], position: int) -> float:
    """The median of sorted `ranked` with the value at `position` left out, in O(1)."""
    n = len(ranked) - 1

    def kept(i: int) -> float:  # the i-th smallest of what is left
        return ranked[i] if i < position else ranked[i + 1]

    middle = n // 2
    return kept(middle) if n % 2 else (kept(middle - 1) + kept(middle)) / 2
