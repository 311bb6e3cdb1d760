"""The guard (`spec.guard`): a step whose gradient is not finite on one rank is skipped on every
rank alike; a loss spike, or non-finite steps in a row, roll every rank back to a state saved
before it and skip the batches that led to it; a run that keeps diverging fails, saying why.

Real agent, real trainer ranks (gloo, two data-parallel ranks), the trouble injected from the
spec: `nonfinite_grad` sets one of the rank's gradients to NaN once they are synced, as a
corrupt batch or an overflow would leave them; `corrupt_weights` multiplies a rank's weights
by 8 before a step, as silent data corruption would, and the step's loss spikes.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tests.faults.harness import Agents, training_spec
from training.agent.node_agent import ExitCode
from training.config import GuardConfig, RunSpec

pytestmark = pytest.mark.slow


def test_a_nonfinite_gradient_on_either_rank_skips_that_step_on_both_and_training_goes_on(
    agents: Agents, tmp_path: Path
) -> None:
    losses = {}
    for rank in (0, 1):
        # once: false, as a corrupt batch would: a resume that replays step 3 meets it again.
        spec = training_spec(steps=8, faults=[{"kind": "nonfinite_grad", "rank": rank, "step": 3, "once": False}])
        run = agents.run(spec, tmp_path / f"nan-on-rank-{rank}")
        assert run.process.returncode == 0, run.tail()
        (skipped,) = run.of_kind("step_skipped")
        assert (skipped["step"], skipped["skipped"], skipped["in_a_row"]) == (3, 1, 1)
        # Rank 0 reports: its own norm is NaN, or, with rank 1's gradient spoiled, finite (the
        # gradients are reduced before the NaN is set, so only rank 1 sees it) and the verdict rank 1's.
        if rank == 0:
            assert skipped["reason"].startswith("loss ") and skipped["reason"].endswith("gradient norm nan: not finite")
        else:
            assert skipped["reason"].startswith("not finite on another rank (rank 0 saw loss "), skipped
        metrics = {m["step"]: m for m in run.of_kind("metrics")}
        assert sorted(metrics) == list(range(1, 9))
        # The step's loss was measured before its gradient was spoiled; rank 0's norm has no
        # number where its own gradient was spoiled.
        assert metrics[3]["skipped"] is True and (metrics[3]["grad_norm"] is None) == (rank == 0)
        assert all(math.isfinite(m["loss"]) and not m.get("skipped") for s, m in metrics.items() if s != 3)
        assert run.events[-1]["kind"] == "succeeded"
        losses[rank] = run.losses()
    # The verdict rides the loss's all-reduce: whichever rank saw the NaN, both skipped step 3,
    # so both runs trained the same steps on the same batches, to the same losses bit for bit.
    # Had only the spoiled rank skipped, the replicas would have parted there, each run otherwise.
    assert losses[0] == losses[1]


# A window of 8 steps, so the tiny runs are judged from their 9th step on.
SPIKE_GUARD = {"window": 8, "rollback_skip_batches": 3}


def guarded_spec(*, steps: int, faults: list[dict[str, object]], **guard: object) -> RunSpec:
    return dataclasses.replace(
        training_spec(steps=steps, faults=faults), guard=GuardConfig(**(SPIKE_GUARD | guard))  # type: ignore[arg-type]
    )


def test_a_loss_spike_rolls_back_skips_its_batches_and_a_crash_after_resumes_on_that_curve(
    agents: Agents, tmp_path: Path
) -> None:
    corrupt = {"kind": "corrupt_weights", "rank": 1, "step": 14}
    spiked = agents.run(guarded_spec(steps=20, faults=[corrupt]), tmp_path / "spiked")
    assert spiked.process.returncode == 0, spiked.tail()
    (rollback,) = spiked.of_kind("rolled_back")
    # Back to the newest state from before step 14 (the checkpoint of step 12, or an in-memory
    # snapshot of 12 or 13), skipping the batches from there to 14 and at least 3.
    target = rollback["to_step"]
    assert rollback["step"] == 14 and 12 <= target <= 13 and rollback["rollbacks"] == 1
    assert rollback["skipped_batches"] == max(3, 14 - target)
    assert rollback["reason"].startswith("loss spike at step 14: ")
    metrics = {m["step"]: m for m in spiked.of_kind("metrics")}
    assert sorted(metrics) == list(range(1, 21))
    # Each step's last report is of the run after the rollback: near the loss before the spike,
    # which the replayed steps' losses follow, and never the spike's (it is reported only in the event).
    before = [metrics[s]["loss"] for s in range(target - 3, target + 1)]
    assert all(metrics[s]["loss"] < 1.5 * max(before) for s in range(target + 1, 21)), metrics
    assert spiked.events[-1]["kind"] == "succeeded"
    # No checkpoint of the abandoned steps survives: 16 and 20, saved after the rollback, are the newest.
    checkpoints = sorted(int(p.name.removeprefix("step_")) for p in (spiked.run_dir / "checkpoints").glob("step_*"))
    assert checkpoints[-2:] == [16, 20]

    # The same run, its rank 0 killed at step 18 (after the rollback and the checkpoint of 16):
    # the resumed ranks skip the same batches (the data position counts them) and end on the
    # same losses bit for bit.
    crashed = agents.run(
        guarded_spec(steps=20, faults=[corrupt, {"kind": "kill_rank", "rank": 0, "step": 18}]), tmp_path / "crashed"
    )
    assert crashed.process.returncode == 0, crashed.tail()
    assert [r["from_step"] for r in crashed.of_kind("restarting")] == [16], crashed.failures()
    assert crashed.losses() == spiked.losses()


def test_a_run_that_keeps_diverging_rolls_back_to_older_states_then_fails_naming_why(
    agents: Agents, tmp_path: Path
) -> None:
    # Step 10 corrupts the weights every time it runs (once: false), as a bad kernel would.
    corrupt = {"kind": "corrupt_weights", "rank": 0, "step": 10, "once": False}
    run = agents.run(guarded_spec(steps=14, faults=[corrupt], max_rollbacks=2), tmp_path / "diverging")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    first, second = run.of_kind("rolled_back")
    assert (first["step"], second["step"]) == (10, 10)
    # The state the first rollback went to did not cure it, so the second went to an older one.
    assert second["to_step"] < first["to_step"] < 10 and second["rollbacks"] == 2
    assert run.of_kind("restarting") == []  # a diverging model is not retried: a resume would diverge again
    final = run.events[-1]
    assert final["kind"] == "failed" and final["data"]["error_class"] == "training"
    reason = final["data"]["reason"]
    assert reason.startswith("training error (not retried): loss spike at step 10: ") and (
        "after 2 rollbacks (guard.max_rollbacks)" in reason
    ), reason


def test_nonfinite_steps_in_a_row_roll_back_and_a_run_whose_steps_stay_nonfinite_fails_naming_them(
    agents: Agents, tmp_path: Path
) -> None:
    faults = [{"kind": "nonfinite_grad", "rank": 1, "step": step, "once": False} for step in (5, 6, 7, 8)]
    spec = guarded_spec(steps=10, faults=faults, max_nonfinite_in_a_row=2, max_rollbacks=1)
    run = agents.run(spec, tmp_path / "diverged")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    (rollback,) = run.of_kind("rolled_back")
    assert rollback["step"] == 6 and rollback["to_step"] <= 5 and rollback["reason"].startswith(
        "the loss or gradient norm was not finite at 2 steps in a row (the last, step 6: "
    )
    assert [s["step"] for s in run.of_kind("step_skipped")][:2] == [5, 6]
    assert run.of_kind("restarting") == []
    final = run.events[-1]
    assert final["kind"] == "failed" and final["data"]["error_class"] == "training"
    assert final["data"]["reason"].startswith(
        "training error (not retried): the loss or gradient norm was not finite at 2 steps in a row (the last, step "
    ) and final["data"]["reason"].endswith(
        "after 1 rollback (guard.max_rollbacks): the run keeps diverging; lower train.lr or train.grad_clip, "
        "raise train.warmup_steps, or check the data"
    )


def test_a_rank_on_a_slow_host_is_named_a_straggler_and_the_others_are_not(agents: Agents, tmp_path: Path) -> None:
    # Rank 1's host stalls 0.2 s before each step from step 3 on, as a busy or throttled host would.
    spec = guarded_spec(steps=10, faults=[{"kind": "slow_steps", "rank": 1, "step": 3}], straggler_steps=4)
    run = agents.run(spec, tmp_path / "straggling")
    assert run.process.returncode == 0, run.tail()
    (straggler,) = run.of_kind("straggler")
    # Slow at steps 3, 4, 5 and 6: named by the fourth, once, with its own time and the other's
    # (a tiny step's ~50 ms against ~250 ms: the other rank's wait for it is not its own time).
    # Sooner where its first steps were slower too (a busy machine's noise: the product waits 20).
    assert (straggler["rank"], straggler["steps"]) == (1, 4) and 4 <= straggler["step"] <= 6, straggler
    assert straggler["own_s"] >= 0.2 and straggler["slower_by"] >= 2, straggler
    assert run.of_kind("straggler_cleared") == []
    assert run.events[-1]["kind"] == "succeeded"
