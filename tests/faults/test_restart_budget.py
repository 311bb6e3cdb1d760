"""What the restart budget spends: failures in a row without progress, never a cure-less error.

Real agent, real trainer ranks (gloo, two data-parallel ranks).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.harness import Agents, training_spec
from training.agent.node_agent import ExitCode
from training.config import RunSpec

pytestmark = pytest.mark.slow


def test_a_long_run_that_fails_more_often_than_the_budget_but_saves_progress_in_between_succeeds(
    agents: Agents, tmp_path: Path
) -> None:
    # Three crashes, each after a newer checkpoint than the attempt resumed from: the budget of
    # one restart comes back each time.
    faults = [{"kind": "kill_rank", "rank": r, "step": s} for r, s in ((1, 3), (0, 6), (1, 9))]
    spec = training_spec(steps=12, checkpoint_interval=2, faults=faults, nodes={"max_restarts": 1})
    run = agents.run(spec, tmp_path / "run")
    assert run.process.returncode == ExitCode.SUCCEEDED, run.tail()
    restarts = run.of_kind("restarting")
    # Three restarts or more (a busy host may add a false hang to the injected crashes), each from
    # a newer checkpoint than the one before, so each found the budget whole again.
    from_steps = [r["from_step"] for r in restarts]
    assert len(from_steps) >= 3 and {2, 4, 8} <= set(from_steps)
    assert from_steps == sorted(set(from_steps))
    assert [r["restarts_left"] for r in restarts] == [0] * len(restarts)
    assert sorted(run.losses()) == list(range(1, 13))
    assert run.events[-1]["kind"] == "succeeded"


def test_a_dataset_that_is_not_valid_fails_the_run_at_once_with_its_reason(agents: Agents, tmp_path: Path) -> None:
    dataset = tmp_path / "notes.jsonl"
    dataset.write_text('{"text": "a good row"}\n{"title": "a row without text"}\n')
    data = training_spec().to_dict()
    data["data"]["dataset"] = str(dataset)
    data["nodes"]["max_restarts"] = 3
    run = agents.run(RunSpec.from_dict(data), tmp_path / "run")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    assert run.of_kind("restarting") == []  # none of the 3 restarts was spent on it
    final = run.events[-1]
    assert final["kind"] == "failed"
    assert final["data"]["error_class"] == "data"
    assert final["data"]["restarts"] == 0
    reason = final["data"]["reason"]
    assert reason.startswith("data error (not retried): data.dataset ")
    assert "notes.jsonl:2: a row needs a 'text' or 'messages' field" in reason


def test_a_tokenizer_that_does_not_load_fails_the_run_at_once(agents: Agents, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text('{"model": "not a tokenizer"}')
    data = training_spec().to_dict()
    data["data"]["tokenizer"] = str(tokenizer)
    run = agents.run(RunSpec.from_dict(data), tmp_path / "run")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    assert run.of_kind("restarting") == []
    final = run.events[-1]["data"]
    assert final["error_class"] == "tokenizer"
    assert final["reason"].startswith(f"tokenizer error (not retried): data.tokenizer {tokenizer}: cannot be loaded")
