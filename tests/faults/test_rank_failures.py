"""A rank that dies, hangs, or dies while a checkpoint is written: the agent resumes the run.

Real agent, real trainer ranks (gloo, two data-parallel ranks), faults injected from the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.faults.harness import Agents, IngestServer, fault_fired_at, training_spec
from training.agent.node_agent import AgentConfig
from training.config import RunSpec

pytestmark = pytest.mark.slow


# SIGKILL from outside (the OOM killer, a user); SIGSEGV from inside, as a crash in native code.
@pytest.mark.parametrize(("fault", "signal_name"), [("kill_rank", "SIGKILL"), ("crash_rank", "SIGSEGV")])
def test_a_rank_killed_mid_step_resumes_on_the_uninterrupted_loss_curve(
    agents: Agents, uninterrupted: Callable[[RunSpec], dict[int, float]], tmp_path: Path, ingest: IngestServer,
    fault: str, signal_name: str,
) -> None:
    spec = training_spec(faults=[{"kind": fault, "rank": 1, "step": 7}])
    faulty = agents.run(
        spec,
        tmp_path / "faulty",
        events_url=ingest.url,
        run_token=ingest.token,
    )
    assert faulty.process.returncode == 0, faulty.tail()
    failure = faulty.of_kind("rank_failed")[0]
    assert (failure["rank"], failure["reason"], failure["signal"]) == (1, "killed by signal", signal_name)
    if fault == "crash_rank":  # the crashed rank's log says where every thread of it was
        log = (faulty.run_dir / "logs" / "rank1.log").read_text()
        assert "Fatal Python error: Segmentation fault" in log
        assert "in _fire" in log and "heartbeat.py" in log, log[-3000:]  # the crashing thread and the others
    assert [r["from_step"] for r in faulty.of_kind("restarting")] == [4], faulty.failures()
    # Rank 0's all-reduce of step 7 broke: it copied step 6, which it held whole, into memory
    # before it exited, and rank 1 (its replica) resumed from that copy. Only step 7 is trained again.
    assert [(r["step"], r["source"], r["at_failure"]) for r in faulty.of_kind("resumed")] == [(6, "memory", True)]
    assert faulty.losses() == uninterrupted(spec)
    assert sorted(faulty.losses()) == list(range(1, 13))
    assert [e["kind"] for e in faulty.events][-1] == "succeeded"
    # Every event reached the control plane, once.
    assert ingest.duplicates == 0
    assert ingest.held("node-0") == [{k: e[k] for k in ("seq", "kind", "time", "data")} for e in faulty.events]


def test_a_stopped_rank_is_declared_hung_within_the_timeout_and_the_run_resumes(agents: Agents, tmp_path: Path) -> None:
    spec = training_spec(faults=[{"kind": "hang_rank", "rank": 1, "step": 6}])
    run = agents.run(spec, tmp_path / "run")
    assert run.process.returncode == 0, run.tail()
    failure = run.of_kind("rank_failed")[0]
    assert (failure["rank"], failure["reason"]) == (1, "hung")
    # SIGSTOP froze the rank's beat thread with it, so its last beat is at most one beat interval
    # older than the fault. That beat names the step the rank was in or had last finished, which
    # is no earlier than any step rank 0 had finished by then (the ranks meet in each step's
    # all-reduce; a beat during step 4's checkpoint names step 4). A tiny step takes ~50 ms, so
    # a beat every 250 ms may lag several steps behind the hang.
    fired = fault_fired_at(run.run_dir)
    last_beat_no_earlier_than = fired - AgentConfig.heartbeat_interval - 0.1
    finished_by_then = [m["step"] for m in run.of_kind("metrics") if m["time"] < last_beat_no_earlier_than]
    assert max(finished_by_then, default=0) <= failure["last_step"] <= 6
    # The contract of the watchdog, not a speed figure: a silent rank is declared hung once its
    # last beat is older than the timeout, and the check runs every 50 ms.
    timeout = spec.nodes.heartbeat_timeout
    assert failure["silent_for"] > timeout
    assert failure["time"] - fired <= timeout + 1.0
    # Its stacks were dumped into its log before it was killed.
    assert "most recent call first" in (run.run_dir / "logs" / "rank1.log").read_text()
    # Once the hung rank was killed, rank 0's all-reduce of step 6 broke and it copied step 5 into memory.
    assert [(r["step"], r["source"], r["at_failure"]) for r in run.of_kind("resumed")] == [(5, "memory", True)]
    assert run.of_kind("finished")[-1]["step"] == 12


def test_a_rank_killed_while_committing_a_checkpoint_leaves_the_previous_one_in_use(
    agents: Agents, tmp_path: Path
) -> None:
    # Without in-memory snapshots, as when the host is lost: rank 0 would otherwise copy step 8 into
    # memory as the save broke, and the restart would resume from there, not from disk.
    spec = training_spec(faults=[{"kind": "kill_during_checkpoint", "rank": 1, "step": 8}]).to_dict()
    spec["train"]["memory_snapshots"] = False
    run = agents.run(RunSpec.from_dict(spec), tmp_path / "run")
    assert run.process.returncode == 0, run.tail()
    kinds = [(e["kind"], e["data"].get("step")) for e in run.events]
    failed_at = kinds.index(("rank_failed", None))
    assert ("checkpoint", 8) not in kinds[:failed_at]  # the interrupted save never committed
    assert [r["from_step"] for r in run.of_kind("restarting")] == [4]
    assert [r["step"] for r in run.of_kind("resumed")] == [4]
    assert ("checkpoint", 8) in kinds[failed_at:]  # saved again by the resumed run
    assert sorted(run.losses()) == list(range(1, 13))
    assert run.of_kind("finished")[-1]["step"] == 12
