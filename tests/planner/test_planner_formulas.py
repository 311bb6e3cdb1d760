"""The planner's formulas against hand-computed small cases and against the model's own code."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from training.config import ModelConfig, Schedule
from training.metrics import flops_per_token
from training.model import Transformer, cross_entropy_loss
from training.planner.hardware import DEVICES, Cluster
from training.planner.layout_costs import (
    BEFORE_FIXES,
    FATHOM,
    Candidate,
    Estimate,
    Rejected,
    estimate,
    rank_shares,
    stage_params,
)
from training.planner.model_shapes import (
    MODEL_NAMES,
    Shape,
    layer_saved,
    model_flops_per_token,
    model_preset,
    num_params,
    output_saved,
    saved_per_token,
)
from training.planner.search import fit_reason

H100_128 = Cluster(device=DEVICES["h100"], nodes=128, devices_per_node=8)
TINY = ModelConfig(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=24)


def ok(result: Estimate | Rejected) -> Estimate:
    assert isinstance(result, Estimate), result
    return result


def test_parameter_counts_equal_model_config_and_llama3s_published_totals() -> None:
    for name in MODEL_NAMES:
        m = model_preset(name)
        assert num_params(m) == m.num_params()
    # Hugging Face's counts for Meta-Llama-3.1-8B / 70B / 405B.
    assert num_params(model_preset("8b")) == 8_030_261_248
    assert num_params(model_preset("70b")) == 70_553_706_496
    assert num_params(model_preset("405b")) == 405_853_388_800


def test_two_pipeline_stages_hold_every_parameter_once() -> None:
    m = model_preset("8b")
    shares = rank_shares(Shape.of(m), pp=2, stages_per_rank=1)
    assert (
        stage_params(Shape.of(m), shares["first"], 1) + stage_params(Shape.of(m), shares["last"], 1) == m.num_params()
    )
    uneven = rank_shares(Shape.of(model_preset("405b")), pp=4, stages_per_rank=1)  # 126 layers: 32, 32, 31, 31
    assert (uneven["first"].layers, uneven["last"].layers) == (32, 31)


def test_doubling_tp_halves_the_split_activations_and_not_the_gathered_ones() -> None:
    s = Shape.of(model_preset("70b"))
    for entry in layer_saved(s):
        two, four = entry.bytes_per_token(2, 2), entry.bytes_per_token(4, 2)
        assert four == (two if entry.split == "gathered" else two / 2), entry.name


def test_doubling_tp_halves_weights_gradients_and_optimizer_state() -> None:
    m = model_preset("70b")
    # Replicated over dp (zero 0), so only tp divides; the last stage (no replicated embedding gradient).
    at = {
        tp: ok(
            estimate(
                m, H100_128, 1024, Candidate(dp=1024 // (tp * 4), tp=tp, pp=4, zero=0, recompute="full", micro_batch=1)
            )
        ).stage_memory["last"]
        for tp in (2, 4)
    }
    for part in ("weights", "grads", "optimizer"):
        # Norm weights are replicated over tp: a few parts per million.
        assert getattr(at[2], part) / getattr(at[4], part) == pytest.approx(2.0, rel=1e-3), part


def test_activation_table_counts_exactly_what_the_model_saves_in_fp32() -> None:
    """Per token, the model saves 8h + 2h·k/a + 4f + a + 2 fp32 elements a block, as layer_saved says."""
    s = Shape.of(TINY)
    assert saved_per_token(layer_saved(s), tp=1, act_bytes=4) == 4 * (8 * 64 + 2 * 64 * 2 / 4 + 4 * 192 + 4 + 2)
    batch = 2
    measured = measure_saved_bytes(TINY, batch, autocast=False)
    tokens = batch * TINY.seq_len
    predicted = tokens * (
        TINY.n_layers * saved_per_token(layer_saved(s), 1, 4) + saved_per_token(output_saved(s), 1, 4) + 8
    )
    assert measured == pytest.approx(predicted, rel=1e-3)


def test_activation_table_counts_what_the_model_saves_under_bf16_autocast() -> None:
    s = Shape.of(TINY)
    batch = 2
    measured = measure_saved_bytes(TINY, batch, autocast=True)
    tokens = batch * TINY.seq_len
    predicted = tokens * (
        TINY.n_layers * saved_per_token(layer_saved(s), 1, 2) + saved_per_token(output_saved(s), 1, 2) + 8
    )
    assert measured == pytest.approx(predicted, rel=0.02)


def measure_saved_bytes(cfg: ModelConfig, batch: int, autocast: bool) -> int:
    """Bytes autograd saves for backward in one forward of training.model, each storage once,
    without weights (and, under autocast, without its bf16 weight copies)."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    skip = {p.untyped_storage().data_ptr() for p in model.parameters()}
    skip |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()} | {tuple(p.shape)[::-1] for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        is_weight_copy = autocast and t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
        if ptr not in skip and not is_weight_copy:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    context = (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if autocast
        else torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), context:
        cross_entropy_loss(model(ids), ids)
    return sum(saved.values())


def test_model_flops_follow_the_trainers_convention() -> None:
    for name in MODEL_NAMES:
        m = model_preset(name)
        assert model_flops_per_token(m) == pytest.approx(flops_per_token(m))


def test_pipeline_bubble_is_stages_minus_one_over_micro_batches_divided_by_virtual_stages() -> None:
    m = model_preset("8b")
    cluster = Cluster(device=DEVICES["h100"], nodes=4, devices_per_node=8)  # 32 devices

    def bubble(pp: int, schedule: Schedule, v: int, mb: int) -> float:
        cand = Candidate(
            dp=32 // pp, tp=1, pp=pp, zero=0, recompute="full", micro_batch=mb, schedule=schedule, stages_per_rank=v
        )
        return ok(estimate(m, cluster, 64, cand)).bubble_fraction

    # 32 devices, global batch 64: with pp 4, dp 8 and 8 sequences per replica.
    assert bubble(4, "1f1b", 1, 1) == pytest.approx(3 / 8)
    assert bubble(4, "interleaved_1f1b", 2, 1) == pytest.approx(3 / 16)
    assert bubble(4, "gpipe", 1, 2) == pytest.approx(3 / 4)
    assert bubble(1, "1f1b", 1, 1) == 0.0


def test_higher_zero_stages_hold_less_between_steps() -> None:
    m = model_preset("8b")
    states = {}
    for zero in (0, 1, 2, 3):
        e = ok(estimate(m, H100_128, 1024, Candidate(dp=128, tp=8, pp=1, zero=zero, recompute="full", micro_batch=1)))
        states[zero] = e.memory
    assert states[0].states > states[1].states
    assert states[1].states == states[2].states == states[3].states  # FSDP2 shards all three at zero 1-3
    assert states[0].weights / states[3].weights == pytest.approx(128)
    assert states[0].optimizer / states[3].optimizer == pytest.approx(128)
    # zero 1/2 keep the gathered weights from forward to backward; zero 3 only a block or two.
    assert states[2].working_weights > states[3].working_weights


def test_it_refuses_tp_that_does_not_divide_the_kv_heads_in_the_run_specs_words() -> None:
    result = estimate(
        model_preset("70b"), H100_128, 1024, Candidate(dp=64, tp=16, pp=1, zero=3, recompute="full", micro_batch=1)
    )
    assert isinstance(result, Rejected)
    assert result.field == "layout.tp"
    assert result.reason == "layout.tp: must divide model.n_kv_heads; got tp=16, n_kv_heads=8"


def test_it_refuses_a_1f1b_pipeline_with_fewer_micro_batches_than_stages() -> None:
    cand = Candidate(dp=128, tp=1, pp=8, zero=0, recompute="full", micro_batch=8)  # 8 sequences: 1 micro-batch
    result = estimate(model_preset("8b"), H100_128, 1024, cand)
    assert isinstance(result, Rejected) and result.field == "layout.microbatches"


def test_a_layout_over_memory_says_how_much_it_needs_and_by_how_much_it_is_over() -> None:
    e = ok(
        estimate(
            model_preset("70b"), H100_128, 1024, Candidate(dp=1024, tp=1, pp=1, zero=0, recompute="none", micro_batch=1)
        )
    )
    assert not e.fits
    match = re.fullmatch(
        r"does not fit: needs ([\d.]+) GiB per device, has 80 GiB \(([\d.]+) GiB over\)", fit_reason(e)
    )
    assert match is not None
    assert float(match[1]) - 80 == pytest.approx(float(match[2]), abs=0.11)


def test_tp_beyond_a_node_is_allowed_but_pays_the_inter_node_link() -> None:
    m = ModelConfig(n_layers=8, dim=2048, n_heads=16, n_kv_heads=16, vocab_size=32768, seq_len=2048)
    cand = Candidate(dp=1, tp=16, pp=1, zero=0, recompute="full", micro_batch=1)
    one_node = ok(estimate(m, Cluster(device=DEVICES["h100"], nodes=1, devices_per_node=16), 4, cand))
    two_nodes = ok(estimate(m, Cluster(device=DEVICES["h100"], nodes=2, devices_per_node=8), 4, cand))
    assert two_nodes.tp.bytes == one_node.tp.bytes
    assert two_nodes.tp.seconds > 5 * one_node.tp.seconds


def test_the_fixes_shrink_what_fathoms_trainer_holds() -> None:
    cand = Candidate(dp=8, tp=8, pp=16, zero=2, recompute="full", micro_batch=1)
    as_is = ok(estimate(model_preset("405b"), H100_128, 1024, cand, impl=BEFORE_FIXES))
    fixed = ok(estimate(model_preset("405b"), H100_128, 1024, cand, impl=FATHOM))
    assert not as_is.fits and fixed.fits
    # The last stage no longer keeps 128 micro-batches of bf16 logits (8,192 × 128,256 × 2 bytes each).
    kept = 127 * 8192 * 128256 * 2
    assert as_is.stage_memory["last"].activations - fixed.stage_memory["last"].activations == pytest.approx(kept)
    assert fixed.dp.bytes < as_is.dp.bytes  # bf16 gathers
    assert dataclasses.replace(FATHOM) == FATHOM


def test_stage_split_is_the_trainers() -> None:
    from training.parallel.dims import ParallelDims, stage_layers

    s = Shape.of(model_preset("405b"))
    for pp, v in ((2, 1), (4, 1), (8, 2), (16, 7)):
        layers = stage_layers(s.L, pp * v)
        dims = ParallelDims(dp=1, tp=1, pp=pp, world_size=pp, stages_per_rank=v)
        shares = rank_shares(s, pp, v)
        assert shares["first"].layers == sum(len(layers[i]) for i in dims.stage_ids(0))
        assert shares["last"].layers == sum(len(layers[i]) for i in dims.stage_ids(pp - 1))
