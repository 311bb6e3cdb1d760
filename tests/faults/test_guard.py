"""The guard (`spec.guard`): a step whose gradient is not finite on one rank is skipped on every
rank alike, and a run whose steps stay non-finite fails at once, saying why.

Real agent, real trainer ranks (gloo, two data-parallel ranks), the NaN injected from the spec
(`nonfinite_grad`: one of the rank's gradients set to NaN once they are synced, as a corrupt
batch or an overflow would leave them).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from tests.faults.harness import Agents, training_spec
from training.agent.node_agent import ExitCode
from training.config import GuardConfig

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


def test_a_run_whose_steps_stay_nonfinite_fails_at_once_naming_them(agents: Agents, tmp_path: Path) -> None:
    faults = [{"kind": "nonfinite_grad", "rank": 1, "step": step, "once": False} for step in (3, 4)]
    spec = dataclasses.replace(training_spec(steps=8, faults=faults), guard=GuardConfig(max_nonfinite_in_a_row=2))
    run = agents.run(spec, tmp_path / "diverged")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    assert [s["step"] for s in run.of_kind("step_skipped")] == [3, 4]
    assert run.of_kind("restarting") == []  # a diverged model is not retried: a resume would diverge again
    final = run.events[-1]
    assert final["kind"] == "failed" and final["data"]["error_class"] == "training"
    assert final["data"]["reason"].startswith(
        "training error (not retried): the loss or gradient norm was not finite at 2 steps in a row (the last, step 4: "
    )
