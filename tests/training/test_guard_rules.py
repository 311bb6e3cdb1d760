"""The guard's judgement of the loss (training/guard.py): what counts as a spike, where a rollback
goes and how many batches it skips. Pure logic; tests/faults/test_guard.py runs it on real ranks."""

from __future__ import annotations

import math

import pytest

from training.config import GuardConfig, RunSpec, SpecError
from training.guard import LossGuard, StragglerWatch


def fed(guard: LossGuard, losses: list[float], first_step: int = 1) -> list[int]:
    """The steps judged spikes, feeding `losses` from `first_step` on."""
    return [step for step, loss in enumerate(losses, first_step) if guard.judge(step, loss) is not None]


def test_no_step_is_judged_before_the_window_is_full() -> None:
    guard = LossGuard(GuardConfig(window=8))
    assert fed(guard, [5.0] * 7 + [50.0]) == []  # the 8th is judged against 7: not yet


def test_a_loss_far_above_the_window_is_a_spike_and_stays_out_of_it() -> None:
    guard = LossGuard(GuardConfig(window=8, spike_zscore=6))
    noisy = [4.0, 4.1, 3.9, 4.05, 3.95, 4.0, 4.1, 3.9]
    assert fed(guard, noisy) == []
    spike = guard.judge(9, 6.0)
    assert spike is not None and spike.step == 9 and spike.zscore > 6
    assert spike.describe().startswith("loss spike at step 9: 6 is ")
    assert 6.0 not in guard.losses  # a spike does not raise the bar for the next one
    assert guard.judge(10, 6.0) is not None


def test_a_falling_loss_and_noise_within_the_threshold_are_not_spikes() -> None:
    guard = LossGuard(GuardConfig(window=8, spike_zscore=6))
    falling = [10 * math.exp(-step / 20) for step in range(60)]
    assert fed(guard, falling) == []
    noise = GuardConfig(window=8, spike_zscore=6)
    steady = LossGuard(noise)
    assert fed(steady, [4.0, 4.2] * 4 + [4.5]) == []  # 0.5 over a mean of 4.1 ± 0.1: z = 4


def test_on_a_flat_plateau_the_deviation_is_floored_at_a_percent_of_the_mean() -> None:
    for loss, spike in ((2.1, False), (2.13, True)):  # 0.1 over: z = 5 in units of 1 % of 2.0; 0.13: 6.5
        guard = LossGuard(GuardConfig(window=8, spike_zscore=6))
        assert fed(guard, [2.0] * 8) == []
        assert (guard.judge(9, loss) is not None) == spike


def test_nonfinite_losses_are_left_to_the_skip_and_spikes_can_be_turned_off() -> None:
    guard = LossGuard(GuardConfig(window=8))
    assert fed(guard, [3.0] * 8 + [math.nan, math.inf]) == []
    assert len(guard.losses) == 8 and all(math.isfinite(x) for x in guard.losses)
    off = LossGuard(GuardConfig(window=8, spike_zscore=0))
    assert not off.watches_spikes and fed(off, [3.0] * 8 + [300.0]) == []


def test_a_rollback_skips_at_least_the_batches_up_to_the_trouble() -> None:
    guard = LossGuard(GuardConfig(window=8, rollback_skip_batches=5))
    assert guard.skipped_batches(trouble_step=20, target_step=18) == 5
    assert guard.skipped_batches(trouble_step=30, target_step=18) == 12


def test_trouble_soon_after_a_rollback_goes_back_further_than_it() -> None:
    guard = LossGuard(GuardConfig(window=8))
    assert guard.rollback_before(40) == 40  # the newest state before the spike
    guard.rolled_back(36, {"losses": [1.0] * 8})
    assert guard.rollback_before(38) == 36  # the state at 36 did not cure it: older than 36
    assert guard.rollback_before(50) == 50  # trouble a window later is trouble of its own


def test_the_window_and_rollbacks_are_saved_and_a_rollback_keeps_its_count() -> None:
    guard = LossGuard(GuardConfig(window=8))
    fed(guard, [3.0] * 10)
    guard.rollbacks = 2
    resumed = LossGuard(GuardConfig(window=8))
    resumed.load_state_dict(guard.state_dict())
    assert list(resumed.losses) == [3.0] * 8 and resumed.rollbacks == 2
    resumed.rolled_back(4, {"losses": [5.0] * 4, "rollbacks": 0})
    assert list(resumed.losses) == [5.0] * 4 and resumed.rollbacks == 2 and resumed.last_target == 4
    before_the_guard = LossGuard(GuardConfig(window=8))
    before_the_guard.load_state_dict(None)  # a checkpoint written before the guard existed
    assert list(before_the_guard.losses) == [] and before_the_guard.rollbacks == 0


@pytest.mark.parametrize(
    ("guard", "field", "message"),
    [
        ({"spike_zscore": 1}, "guard.spike_zscore", "must be 0 (off) or a number ≥ 2"),
        ({"window": 4}, "guard.window", "must be an integer ≥ 8"),
        ({"rollback_skip_batches": -1}, "guard.rollback_skip_batches", "must be an integer ≥ 0"),
        ({"max_rollbacks": 0}, "guard.max_rollbacks", "positive integer"),
        ({"straggler_margin": -0.1}, "guard.straggler_margin", "must be a number from 0 (off) to 10"),
        ({"straggler_steps": 0}, "guard.straggler_steps", "positive integer"),
    ],
)
def test_a_bad_guard_names_its_field(guard: dict[str, object], field: str, message: str) -> None:
    with pytest.raises(SpecError) as error:
        RunSpec.from_dict({"guard": guard})
    assert error.value.field == field and message in str(error.value)


def test_the_median_of_the_others_leaves_out_the_one_judged() -> None:
    from training.guard import _median_without

    ranked = [1.0, 2.0, 3.0, 10.0]
    assert [_median_without(ranked, p) for p in range(4)] == [3.0, 3.0, 2.0, 2.0]
    assert [_median_without([1.0, 5.0], p) for p in range(2)] == [5.0, 1.0]
    assert _median_without([1.0, 2.0, 4.0], 0) == 3.0


def test_a_rank_slower_than_its_peers_for_the_set_steps_is_a_straggler_until_as_many_in_line() -> None:
    watch = StragglerWatch(GuardConfig(straggler_margin=0.25, straggler_steps=3), peers=[[0, 1, 2, 3]])
    assert watch.enabled
    normal = [0.050, 0.051, 0.049, 0.050]
    slow = [0.050, 0.051, 0.049, 0.250]  # rank 3: 5× the others' median
    assert [watch.observe(slow) for _ in range(2)] == [[], []]
    assert watch.observe(normal) == []  # not in a row: counted anew
    assert [watch.observe(slow) for _ in range(2)] == [[], []]
    (became,) = watch.observe(slow)
    assert (became.rank, became.slow, became.steps) == (3, True, 3)
    assert became.as_event() == {"rank": 3, "steps": 3, "own_s": 0.25, "others_s": 0.05, "slower_by": 5.0}
    assert watch.observe(slow) == [] and watch.stragglers == {3}  # reported once
    assert [watch.observe(normal) for _ in range(2)] == [[], []]
    (cleared,) = watch.observe(normal)
    assert (cleared.rank, cleared.slow) == (3, False) and watch.stragglers == set()


def test_two_ranks_compare_each_with_the_other_and_tiny_lags_or_other_stages_are_no_straggling() -> None:
    watch = StragglerWatch(GuardConfig(straggler_margin=0.25, straggler_steps=1), peers=[[0, 1]])
    (became,) = watch.observe([0.100, 0.130])  # 1.3× the other: against the median of both it would hide
    assert became.rank == 1
    tiny = StragglerWatch(GuardConfig(straggler_margin=0.25, straggler_steps=1), peers=[[0, 1]])
    assert tiny.observe([0.001, 0.004]) == []  # 4× but 3 ms: noise
    # Stages are not peers: the first stage's backward waits for the last one's.
    staged = StragglerWatch(GuardConfig(straggler_margin=0.25, straggler_steps=1), peers=[[0, 1], [2, 3]])
    assert staged.observe([0.3, 0.3, 0.1, 0.1]) == []
    assert not StragglerWatch(GuardConfig(), peers=[[0], [1]]).enabled  # pp=2 on two ranks: no peers
    assert not StragglerWatch(GuardConfig(straggler_margin=0), peers=[[0, 1]]).enabled
