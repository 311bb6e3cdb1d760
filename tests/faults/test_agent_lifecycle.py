"""The agent's own outcomes: cancelled by SIGTERM (stopped, under a scheduler), failed after its restart budget,
crash loops back off."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.faults.harness import Agents, training_spec, wait_for
from training.agent.node_agent import ExitCode
from training.heartbeat import read_beat
from training.run_dir import RunDir

pytestmark = pytest.mark.slow


def test_sigterm_cancels_the_run_stops_its_ranks_and_keeps_the_last_checkpoint(agents: Agents, tmp_path: Path) -> None:
    run = agents.start(training_spec(steps=400, checkpoint_interval=4), tmp_path / "run")
    wait_for(lambda: bool(run.of_kind("checkpoint")), 120, "the first checkpoint")
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == ExitCode.CANCELLED, run.tail()

    final = run.events[-1]
    assert final["kind"] == "cancelled"
    assert final["data"]["step"] == RunDir(run.run_dir).latest_committed_step() >= 4
    beats = sorted(RunDir(run.run_dir).node(0).heartbeat_dir.glob("rank*.json"))
    before = [read_beat(b) for b in beats]
    time.sleep(0.5)
    assert [read_beat(b) for b in beats] == before  # no rank is left beating


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["synchronous", "background"])
def test_a_cancel_while_a_checkpoint_is_written_waits_for_its_commit(
    agents: Agents, tmp_path: Path, async_checkpoint: bool
) -> None:
    # Rank 0 takes 5 s over the commit of step 8: the cancel arrives while the save is under way.
    slow_save = {"kind": "slow_checkpoint", "rank": 0, "step": 8}
    spec = training_spec(steps=400, checkpoint_interval=4, async_checkpoint=async_checkpoint, faults=[slow_save])
    run = agents.start(spec, tmp_path / "run")
    wait_for(lambda: any((run.run_dir / "faults").glob("*.fired")), 120, "the slow save of step 8")
    run.process.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == ExitCode.CANCELLED, run.tail()

    assert run.events[-1]["kind"] == "cancelled"
    assert run.events[-1]["data"]["step"] == RunDir(run.run_dir).latest_committed_step() == 8
    assert [c["step"] for c in run.of_kind("checkpoint")] == [4, 8]


def test_a_cancel_file_in_the_run_folder_cancels_the_run(agents: Agents, tmp_path: Path) -> None:
    run = agents.start(training_spec(steps=400, checkpoint_interval=4), tmp_path / "run")
    wait_for(lambda: bool(run.of_kind("metrics")), 120, "the first step")
    RunDir(run.run_dir).cancel_marker.touch()
    assert run.wait(timeout=60) == ExitCode.CANCELLED, run.tail()
    assert run.events[-1]["kind"] == "cancelled"


def test_under_a_scheduler_sigterm_stops_the_node_and_only_the_cancel_file_cancels(agents: Agents, tmp_path: Path) -> None:
    # `--sigterm stop` (Slurm's agents): a requeue or preemption SIGTERMs the job, not the run.
    stopped = agents.start(training_spec(steps=400, checkpoint_interval=4), tmp_path / "stopped", extra=("--sigterm", "stop"))
    wait_for(lambda: bool(stopped.of_kind("checkpoint")), 120, "the first checkpoint")
    stopped.process.send_signal(signal.SIGTERM)
    assert stopped.wait(timeout=60) == ExitCode.STOPPED, stopped.tail()
    assert stopped.events[-1]["kind"] == "stopped"
    assert stopped.events[-1]["data"]["step"] == RunDir(stopped.run_dir).latest_committed_step() >= 4

    cancelled = agents.start(training_spec(steps=400), tmp_path / "cancelled", extra=("--sigterm", "stop"))
    wait_for(lambda: bool(cancelled.of_kind("metrics")), 120, "the first step")
    RunDir(cancelled.run_dir).cancel_marker.touch()
    cancelled.process.send_signal(signal.SIGTERM)  # Fathom's scancel after the grace: still a cancel
    assert cancelled.wait(timeout=60) == ExitCode.CANCELLED, cancelled.tail()
    assert cancelled.events[-1]["kind"] == "cancelled"


def test_a_rank_that_keeps_failing_fails_the_run_after_the_restart_budget(agents: Agents, tmp_path: Path) -> None:
    spec = training_spec(nodes={"max_restarts": 2}, faults=[{"kind": "kill_rank", "rank": 0, "step": 1, "once": False}])
    run = agents.run(spec, tmp_path / "run")
    assert run.process.returncode == ExitCode.FAILED, run.tail()
    assert [f["reason"] for f in run.of_kind("rank_failed") if f["rank"] == 0] == ["killed by signal"] * 3
    # It never got past step 1, so each retry waits longer: 1 s, then 2 s.
    assert [r["backoff"] for r in run.of_kind("restarting")] == [1.0, 2.0]
    final = run.events[-1]
    assert final["kind"] == "failed"
    assert "rank 0 killed by signal" in final["data"]["reason"]


@pytest.mark.parametrize("async_checkpoint", [False, True], ids=["synchronous", "background"])
def test_under_a_scheduler_a_stop_request_checkpoints_the_step_the_ranks_agree_on_and_the_next_start_resumes_there(
    agents: Agents, tmp_path: Path, async_checkpoint: bool
) -> None:
    # What the Slurm batch script does on the time-limit signal; the only periodic checkpoint is
    # the last step's, so a checkpoint before it is the request's.
    spec = training_spec(steps=60, checkpoint_interval=60, async_checkpoint=async_checkpoint)
    run_dir = tmp_path / "run"
    folder = RunDir(run_dir)
    first = agents.start(spec, run_dir, extra=("--sigterm", "stop"))
    wait_for(lambda: len(first.of_kind("metrics")) >= 5, 120, "step 5")
    seen = max(m["step"] for m in first.of_kind("metrics"))
    folder.stop_request.write_text("the time limit is near\n")
    assert first.wait(timeout=60) == ExitCode.STOPPED, first.tail()

    # Rank 0 reports a step's metrics only after the step's end agreed on the request, so the
    # request was not there yet at the end of step `seen`: the ranks stop at a later one.
    (asked,) = first.of_kind("stop_requested")
    step = asked["step"]
    assert seen < step < 60 and asked["reason"] == "the time limit is near"
    assert [c["step"] for c in first.of_kind("checkpoint")] == [step] and folder.latest_committed_step() == step
    assert max(first.losses()) == step  # no rank went past it
    assert first.events[-1]["kind"] == "stopped"
    assert first.events[-1]["data"] == {"step": step, "reason": f"checkpointed step {step} as the scheduler asked: the time limit is near"}

    folder.stop_request.unlink()  # the job's next start removes it
    second = agents.run(spec, run_dir, extra=("--sigterm", "stop"))
    assert second.process.returncode == ExitCode.SUCCEEDED, second.tail()
    assert [r["step"] for r in second.of_kind("resumed")] == [step]
    steps = [m["step"] for m in second.of_kind("metrics")]  # both starts' events: one spool per node
    assert steps == list(range(1, 61))  # every step ran once
    uninterrupted = agents.run(spec, tmp_path / "uninterrupted")
    assert second.losses() == uninterrupted.losses()  # bit for bit
