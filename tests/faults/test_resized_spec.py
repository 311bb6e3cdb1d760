"""The spec the ranks get after the rendezvous formed a smaller world than planned."""

from __future__ import annotations

import json

import pytest

from training.config import NodePlan, RunSpec, SpecError, tiny


def _planned() -> RunSpec:
    data = tiny(dp=2, tp=2).to_dict()
    data["nodes"].update(min=1, max=2)
    data["faults"] = [{"kind": "kill_rank", "rank": 3, "step": 5}, {"kind": "kill_rank", "rank": 1, "step": 6}]
    return RunSpec.from_dict(data)


def test_the_planned_world_keeps_the_spec_as_it_is() -> None:
    spec = _planned()
    assert spec.resized(world_size=4, nodes=2, nproc=2) is spec


def test_losing_a_node_shrinks_data_parallel_and_keeps_tensor_parallel_and_the_global_batch() -> None:
    shrunk = _planned().resized(world_size=2, nodes=1, nproc=2)
    assert (shrunk.layout.dp, shrunk.layout.tp, shrunk.layout.world_size) == (1, 2, 2)
    assert shrunk.train.global_batch == _planned().train.global_batch
    assert (shrunk.nodes.min, shrunk.nodes.max, shrunk.nodes.nproc_per_node) == (1, 1, 2)
    assert [f.rank for f in shrunk.faults] == [1]  # rank 3 no longer exists


def test_a_world_that_splits_a_tensor_parallel_group_is_refused() -> None:
    with pytest.raises(SpecError, match="whole tp·pp groups"):
        _planned().resized(world_size=3, nodes=1, nproc=3)


def test_the_node_agent_reads_only_its_nodes_and_the_planned_world_size() -> None:
    plan = NodePlan.from_json(_planned().to_json())
    assert (plan.nodes.min, plan.nodes.max, plan.world_size, plan.nproc_per_node) == (1, 2, 4, 2)


def test_a_bad_nodes_section_is_refused_with_its_field_by_the_agent() -> None:
    data = _planned().to_dict()
    data["nodes"]["max_restarts"] = -1
    with pytest.raises(SpecError, match="nodes.max_restarts"):
        NodePlan.from_json(json.dumps(data))
