"""When the default (automatic) checkpoint policy saves: Young's rule from the run's own figures."""

from __future__ import annotations

import math

import pytest

from training import checkpoint_policy
from training.checkpoint_policy import (
    FIRST_INTERVAL_STEPS,
    FIRST_SNAPSHOT_STEPS,
    MTBF_PRIOR_S,
    CheckpointPolicy,
    SnapshotPolicy,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(policy: CheckpointPolicy, clock: Clock, steps: range, step_s: float, save_s: float) -> list[int]:
    """Drives `policy` as Trainer.fit does; a save adds `save_s` to the step after it."""
    saved: list[int] = []
    for step in steps:
        clock.now += step_s
        if saved and saved[-1] == step - 1:
            clock.now += save_s
        if policy.due(step):
            saved.append(step)
    return saved


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(checkpoint_policy.time, "perf_counter", clock)
    return clock


def test_a_fixed_interval_saves_every_n_steps_and_the_last(clock: Clock) -> None:
    policy = CheckpointPolicy(interval=4, total_steps=10, first_step=0, attempt=0, distributed=False)
    assert run(policy, clock, range(1, 11), step_s=0.1, save_s=0.5) == [4, 8, 10]


def test_before_any_failure_the_interval_follows_the_prior_failure_rate(clock: Clock) -> None:
    policy = CheckpointPolicy(interval=0, total_steps=100_000, first_step=0, attempt=0, distributed=False)
    saved = run(policy, clock, range(1, 2000), step_s=0.1, save_s=0.02)
    assert saved[0] == FIRST_INTERVAL_STEPS
    young = math.sqrt(2 * 0.02 * MTBF_PRIOR_S)  # 12 s: 120 steps of 0.1 s
    assert policy.young_interval == pytest.approx(young, rel=0.01)
    assert saved[1] - saved[0] == round(young / 0.1)


def test_after_restarts_the_interval_follows_the_runs_own_failure_rate(clock: Clock) -> None:
    # Resumed at step 6000 after 10 restarts: ~600 s of training, a failure every ~60 s.
    policy = CheckpointPolicy(interval=0, total_steps=100_000, first_step=6000, attempt=10, distributed=False)
    assert run(policy, clock, range(6001, 6012), step_s=0.1, save_s=0.02) == [6010]
    young = math.sqrt(2 * 0.02 * (6011 * 0.1 / 10))  # planned at the step after the save
    assert policy.young_interval == pytest.approx(young, rel=0.01)
    assert policy.next_step == 6010 + round(young / 0.1)


def test_in_memory_snapshots_follow_youngs_rule_with_their_own_cost(clock: Clock) -> None:
    policy = SnapshotPolicy(first_step=0, failures=0, distributed=False)
    taken = []
    for step in range(1, 400):
        clock.now += 0.1
        if policy.due(step):
            taken.append(step)
            policy.taken(step, 0.002)
    # Before any failure M is the prior (an hour): τ = √(2 · 0.002 s · 3600 s) ≈ 3.8 s, 38 steps,
    # from the third snapshot on (the first two, one per slot, fault the slots' pages in).
    every = round(math.sqrt(2 * 0.002 * MTBF_PRIOR_S) / 0.1)
    assert every == 38
    third = FIRST_SNAPSHOT_STEPS + 2
    assert taken[:5] == [FIRST_SNAPSHOT_STEPS, third - 1, third, third + every, third + 2 * every]


def test_the_snapshot_interval_plans_only_for_the_failures_that_snapshots_at_the_failure_did_not_cover(
    clock: Clock,
) -> None:
    # Resumed at step 6000 after restarts of which 2 resumed from a periodic snapshot or from disk:
    # M is ~600 s of training over those 2, whatever number of crashes a copy taken at the failure covered.
    policy = SnapshotPolicy(first_step=6000, failures=2, distributed=False)
    measured = 6000 + FIRST_SNAPSHOT_STEPS + 2
    for step in range(6001, measured + 1):
        clock.now += 0.1
        if policy.due(step):
            policy.taken(step, 0.002)
    assert policy.every == round(math.sqrt(2 * 0.002 * (measured * 0.1 / 2)) / 0.1)


def test_the_snapshot_interval_is_not_set_by_the_snapshots_that_fault_their_slots_in(clock: Clock) -> None:
    policy = SnapshotPolicy(first_step=0, failures=0, distributed=False)
    for step in range(1, FIRST_SNAPSHOT_STEPS + 3):
        clock.now += 0.1
        if policy.due(step):
            # A slot's first copy faults its pages in: 10× what a copy costs once they are in memory.
            policy.taken(step, 0.002 if step == FIRST_SNAPSHOT_STEPS + 2 else 0.02)
    assert policy.cost == pytest.approx(0.002)
    assert policy.every == round(math.sqrt(2 * 0.002 * MTBF_PRIOR_S) / 0.1)


def test_with_in_memory_snapshots_the_disk_interval_ignores_rank_restarts(clock: Clock) -> None:
    policy = CheckpointPolicy(
        interval=0, total_steps=100_000, first_step=6000, attempt=10, distributed=False, memory_snapshots=True
    )
    run(policy, clock, range(6001, 6012), step_s=0.1, save_s=0.02)
    assert policy.young_interval == pytest.approx(math.sqrt(2 * 0.02 * MTBF_PRIOR_S), rel=0.01)


def test_a_rank_resumed_from_memory_carries_on_with_the_disk_plan_its_snapshot_kept(clock: Clock) -> None:
    before = CheckpointPolicy(interval=0, total_steps=100_000, first_step=0, attempt=0, distributed=False)
    saved = run(before, clock, range(1, 30), step_s=0.1, save_s=0.02)
    assert saved == [FIRST_INTERVAL_STEPS]  # then the next save is planned ~120 steps later
    after = CheckpointPolicy(
        interval=0, total_steps=100_000, first_step=29, attempt=1, distributed=False, memory_snapshots=True
    )
    after.load_state_dict(before.state_dict())
    # No save FIRST_INTERVAL_STEPS into the new attempt: the plan made before the failure holds.
    assert run(after, clock, range(30, 200), step_s=0.1, save_s=0.02) == [before.next_step]
