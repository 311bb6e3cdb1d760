"""A rank killed on a host that lives on resumes from the ranks' in-memory snapshots, newer than
any disk checkpoint, and lands on the loss curve of a run that was never interrupted.

Real agent, real trainer ranks (gloo), the product's default `train.memory_snapshots`; the disk
checkpoint is only the last step's, so a resume from disk would start over from step 0. Three
layouts, since each keeps its state differently: plain data parallel, tensor parallel (DTensor
parameters and optimizer state) and ZeRO-3 (FSDP2 shards).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import Agents, training_spec
from training.config import RunSpec
from training.run_dir import RunDir

pytestmark = pytest.mark.slow

STEPS = 24
KILLED_AT = 18


def _spec(layout: dict[str, Any], faults: list[dict[str, Any]]) -> RunSpec:
    data = training_spec(steps=STEPS, checkpoint_interval=STEPS, faults=faults).to_dict()
    data["layout"].update(layout)
    return RunSpec.from_dict(data)


@pytest.mark.parametrize("layout", [{"dp": 2}, {"dp": 1, "tp": 2}, {"dp": 2, "zero": 3}], ids=["dp2", "tp2", "zero3"])
def test_a_killed_rank_resumes_from_memory_on_the_uninterrupted_loss_curve(
    agents: Agents, uninterrupted: Callable[[RunSpec], dict[int, float]], tmp_path: Path, layout: dict[str, Any]
) -> None:
    spec = _spec(layout, [{"kind": "kill_rank", "rank": 1, "step": KILLED_AT}])
    faulty = agents.run(spec, tmp_path / "faulty")
    assert faulty.process.returncode == 0, faulty.tail()
    assert [r["from_step"] for r in faulty.of_kind("restarting")] == [0]  # no disk checkpoint yet
    (resumed,) = faulty.of_kind("resumed")
    assert resumed["source"] == "memory"
    if layout == {"dp": 2}:
        # Rank 0's all-reduce of step 18 broke; it copied step 17, which rank 1 also held (a
        # replica), into memory as it failed, and both resumed from that copy.
        assert (resumed["step"], resumed["at_failure"]) == (KILLED_AT - 1, True)
    else:
        # Rank 1's shard is in no other rank: both resumed from the last periodic snapshot, which
        # is step 17 itself where the interval lands there (CI saw every 13 steps from step 4).
        assert 0 < resumed["step"] < KILLED_AT
        assert resumed["at_failure"] is False
    assert faulty.losses() == uninterrupted(spec)
    assert sorted(faulty.losses()) == list(range(1, STEPS + 1))
    # The agent removed the snapshots from shared memory when it exited.
    assert not RunDir(tmp_path / "faulty").memory_snapshot_dir.exists()


def test_progress_kept_only_in_memory_gives_the_restart_budget_back(agents: Agents, tmp_path: Path) -> None:
    """Three crashes, one restart allowed in a row, no disk checkpoint before the last step: each
    attempt moved the newest snapshot on, so none of them counts against the budget."""
    data = _spec({"dp": 2}, [{"kind": "kill_rank", "rank": 1, "step": s} for s in (8, 14, 20)]).to_dict()
    data["nodes"]["max_restarts"] = 1
    run = agents.run(RunSpec.from_dict(data), tmp_path / "run")
    assert run.process.returncode == 0, run.tail()
    assert len(run.of_kind("restarting")) == 3
    assert [r["source"] for r in run.of_kind("resumed")] == ["memory"] * 3
    assert sorted(run.losses()) == list(range(1, STEPS + 1))
