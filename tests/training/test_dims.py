"""Layout arithmetic, checked without starting any process."""

from __future__ import annotations

import math

import pytest

from training.config import SpecError, TrainConfig, tiny
from training.parallel.dims import LayoutError, ParallelDims, batch_shape, stage_layers
from training.parallel.fsdp import reshard_after_forward
from training.trainer import lr_at


def test_it_accepts_a_layout_whose_degrees_multiply_to_the_world_size() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8, zero=3)
    assert dims.fsdp_enabled and not dims.replicate_enabled
    assert dims.num_stages == 2


def test_it_rejects_degrees_that_do_not_multiply_to_the_world_size() -> None:
    with pytest.raises(LayoutError, match="2·2·1 = 4 must equal the world size 8"):
        ParallelDims(dp=2, tp=2, pp=1, world_size=8)


def test_it_rejects_zero_sharding_without_data_parallelism() -> None:
    with pytest.raises(LayoutError, match="zero=3 shards over dp, which is 1"):
        ParallelDims(dp=1, tp=2, pp=1, world_size=2, zero=3)


def test_plain_data_parallelism_is_used_only_for_zero_0_with_several_replicas() -> None:
    assert ParallelDims(dp=2, tp=1, pp=1, world_size=2).replicate_enabled
    assert not ParallelDims(dp=1, tp=2, pp=1, world_size=2).replicate_enabled


def test_coordinates_put_tp_innermost_and_pp_outermost() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert dims.coordinates(0) == {"pp": 0, "dp": 0, "tp": 0}
    assert dims.coordinates(1) == {"pp": 0, "dp": 0, "tp": 1}
    assert dims.coordinates(2) == {"pp": 0, "dp": 1, "tp": 0}
    assert dims.coordinates(7) == {"pp": 1, "dp": 1, "tp": 1}
    with pytest.raises(LayoutError):
        dims.coordinates(8)


def test_a_ranks_replicas_are_its_dp_peers_only_when_the_state_is_not_sharded_over_dp() -> None:
    # What a rank that died may restore from: the snapshot of a rank holding the same state.
    dims = ParallelDims(dp=2, tp=2, pp=2, world_size=8)
    assert dims.replicas(0) == [0, 2]
    assert dims.replicas(7) == [5, 7]
    assert ParallelDims(dp=1, tp=2, pp=1, world_size=2).replicas(1) == [1]
    assert ParallelDims(dp=2, tp=1, pp=1, world_size=2, zero=1).replicas(0) == [0]


def test_interleaved_stages_are_looped_over_pipeline_ranks() -> None:
    dims = ParallelDims(dp=1, tp=1, pp=2, world_size=2, stages_per_rank=2)
    assert dims.num_stages == 4
    assert dims.stage_ids(0) == [0, 2]
    assert dims.stage_ids(1) == [1, 3]


def test_layers_split_contiguously_with_the_remainder_on_the_first_stages() -> None:
    assert stage_layers(4, 2) == [[0, 1], [2, 3]]
    assert stage_layers(5, 3) == [[0, 1], [2, 3], [4]]
    assert sum(stage_layers(7, 7), []) == list(range(7))


def test_it_rejects_more_pipeline_stages_than_layers() -> None:
    with pytest.raises(LayoutError, match="5 pipeline stages"):
        stage_layers(4, 5)


def test_batch_shape_cuts_the_global_batch_over_dp_accumulation_and_micro_batches() -> None:
    spec = tiny(dp=2, pp=2, microbatches=2)
    spec.train.global_batch, spec.train.grad_accum = 16, 2
    spec.__post_init__()
    shape = batch_shape(spec)
    assert (shape.local_batch, shape.micro_batch, shape.pipeline_chunk) == (8, 4, 2)
    assert shape.backward_passes == 4  # 2 accumulation passes × 2 pipeline micro-batches


def test_the_spec_rejects_micro_batches_that_do_not_divide_the_local_batch() -> None:
    with pytest.raises(SpecError, match="layout.microbatches"):
        tiny(dp=2, pp=2, microbatches=3, schedule="gpipe")


def test_zero_3_reshards_after_forward_and_zero_1_and_2_do_not() -> None:
    assert reshard_after_forward(3) is True
    assert reshard_after_forward(2) is False
    assert reshard_after_forward(1) is False
    with pytest.raises(ValueError):
        reshard_after_forward(0)


def test_learning_rate_warms_up_linearly_then_decays_to_the_floor() -> None:
    cfg = TrainConfig(steps=20, lr=1e-3, min_lr=1e-4, warmup_steps=4)
    assert lr_at(1, cfg) == pytest.approx(2.5e-4)
    assert lr_at(4, cfg) == pytest.approx(1e-3)
    assert lr_at(12, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, cfg) == pytest.approx(1e-4)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(4, 20))
