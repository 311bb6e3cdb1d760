"""Two node agents on 127.0.0.1 (2 ranks each) train one job; one agent is SIGKILLed mid-run.

`nodes.min` decides what follows: with min=1 the survivor re-forms the job alone (data parallel
shrinks from 4 to 2); with min=2 it waits for a replacement node, which the control plane would
start, and the job restarts with both.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.faults.harness import ROOT, AgentRun, Agents, free_port, training_spec, wait_for
from training.config import RunSpec
from training.heartbeat import read_beat
from training.ports import RANK_STORE_PORTS
from training.run_dir import CheckpointDir, RunDir

pytestmark = pytest.mark.slow

# Once one agent has joined, wait this long for the other before starting without it (both
# agents start together; importing torch takes a few seconds on a loaded machine).
LAST_CALL = ("--rdzv-last-call", "8")


def _start_pair(agents: Agents, run_dir: Path, nodes: dict[str, int]) -> tuple[AgentRun, AgentRun, str]:
    spec = training_spec(dp=4, nodes=nodes, faults=[{"kind": "kill_agent", "node": 1, "step": 6}])
    endpoint = f"127.0.0.1:{free_port()}"
    node0 = agents.start(spec, run_dir, node_rank=0, rdzv_endpoint=endpoint, extra=LAST_CALL)
    node1 = agents.start(spec, run_dir, node_rank=1, rdzv_endpoint=endpoint, extra=LAST_CALL)
    return node0, node1, endpoint


def _ranks_of_dead_agent_are_gone(run: AgentRun) -> bool:
    """No rank of the killed agent still beats (they die with it: PR_SET_PDEATHSIG)."""
    files = list((run.run_dir / f"node{run.node_rank}" / "heartbeat").glob("rank*.json"))
    before = [read_beat(f) for f in files]
    time.sleep(0.5)
    return before == [read_beat(f) for f in files]


def _assert_the_survivor_went_on_alone(dead: AgentRun, survivor: AgentRun) -> None:
    assert dead.wait() < 0, dead.tail()  # killed by the injected fault
    assert survivor.wait() == 0, survivor.tail()
    assert _ranks_of_dead_agent_are_gone(dead)
    worlds = [r["world_size"] for r in survivor.of_kind("rendezvous")]
    assert worlds[0] == 4 and worlds[-1] == 2
    assert survivor.of_kind("node_lost")[0] | {"time": 0} == {"nodes_before": 2, "nodes": 1, "time": 0}
    # Rank 0, which reports the losses, may have been on either node before the loss.
    assert sorted(dead.losses() | survivor.losses()) == list(range(1, 13))


def test_losing_a_node_with_min_one_continues_on_the_survivor(agents: Agents, tmp_path: Path) -> None:
    node0, node1, _ = _start_pair(agents, tmp_path / "run", {"min": 1, "max": 2})
    _assert_the_survivor_went_on_alone(dead=node1, survivor=node0)
    assert [r["step"] for r in node0.of_kind("resumed")] == [4]
    # The ranks fitted the spec to the smaller world: the checkpoints they wrote after it say dp=2.
    last = RunDir(tmp_path / "run").latest_checkpoint()
    assert last is not None and RunSpec.from_json(CheckpointDir(last).spec_file.read_text()).layout.dp == 2


def test_losing_a_node_with_min_two_restarts_both_when_a_replacement_joins(agents: Agents, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    node0, node1, endpoint = _start_pair(agents, run_dir, {"min": 2, "max": 2})
    assert node1.wait() < 0, node1.tail()
    wait_for(lambda: bool(node0.of_kind("restarting")), 120, "the surviving agent to restart")
    assert node0.process.poll() is None  # waiting for a second node, as min=2 says

    replacement = agents.start(
        training_spec(dp=4, nodes={"min": 2, "max": 2}, faults=[{"kind": "kill_agent", "node": 1, "step": 6}]),
        run_dir,
        node_rank=1,
        rdzv_endpoint=endpoint,
        extra=LAST_CALL,
    )
    assert node0.wait() == 0, node0.tail()
    assert replacement.wait() == 0, replacement.tail()
    restarts = [(r["attempt"], r["reason"]) for r in node0.of_kind("restarting")]
    assert [r["world_size"] for r in node0.of_kind("rendezvous")] == [4, 4], restarts
    # Each attempt's rank 0 store listened on a port below the ephemeral range, which no outgoing
    # connection takes between the agent's pick and the rank's bind; both nodes used the same.
    masters = [r["master"] for r in node0.of_kind("rendezvous")]
    assert all(int(master.rsplit(":", 1)[1]) in RANK_STORE_PORTS for master in masters), masters
    assert replacement.of_kind("rendezvous")[-1]["master"] == masters[-1]
    # Node 0's ranks copied step 5, which they held whole, into shared memory as their collectives
    # broke; both "hosts" here are one machine, so the replacement's ranks (their dp replicas)
    # restore from those copies too. Hosts apart, they would find none and all resume from disk (4).
    resumed = node0.of_kind("resumed") + replacement.of_kind("resumed")
    assert [(r["step"], r["source"], r["at_failure"]) for r in resumed] == [(5, "memory", True)]
    losses = node0.losses() | replacement.losses()  # rank 0 may be on either node in each attempt
    assert sorted(losses) == list(range(1, 13))
    # The replacement agent went on with node 1's event sequence instead of starting over at 1.
    node1_events = replacement.events
    assert [e["seq"] for e in node1_events] == list(range(1, len(node1_events) + 1))
    assert [e["kind"] for e in node1_events].count("agent_started") == 2


def test_losing_node_0_continues_on_node_1_when_the_store_runs_apart(agents: Agents, tmp_path: Path) -> None:
    """With the rendezvous store in its own process (as the launcher starts multi-node runs),
    node 0 is no different from any other node: its loss leaves node 1 to go on alone."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    endpoint = f"127.0.0.1:{free_port()}"
    store = subprocess.Popen(
        [sys.executable, "-m", "training.agent.rendezvous_store", "--endpoint", endpoint, "--run-dir", str(run_dir)],
        cwd=ROOT,
        stdout=(tmp_path / "store.out").open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        spec = training_spec(dp=4, nodes={"min": 1, "max": 2}, faults=[{"kind": "kill_agent", "node": 0, "step": 6}])
        apart = ("--host-store", "no", *LAST_CALL)
        node0 = agents.start(spec, run_dir, node_rank=0, rdzv_endpoint=endpoint, extra=apart)
        node1 = agents.start(spec, run_dir, node_rank=1, rdzv_endpoint=endpoint, extra=apart)
        _assert_the_survivor_went_on_alone(dead=node0, survivor=node1)
    finally:
        store.kill()
        store.wait()
