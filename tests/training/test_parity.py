"""Every parallel layout trains like one process: per-step losses within 1e-4 (fp32) over 5 steps.

Each test launches the layout under torchrun on gloo (real processes, one thread each) and compares
with a single-process run of the same spec, data and seed, shared by the tests of the session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tools.check_parity import Parity, check_parity, launch, parity_spec, reference_spec, step_values
from training.config import DataConfig, RunSpec

STEPS = 5
TOLERANCE = 1e-4
TIMEOUT = 600  # seconds; a hung layout fails its test instead of blocking the suite
Events = list[dict[str, Any]]


def with_data(spec: RunSpec, data: DataConfig) -> RunSpec:
    return RunSpec.from_dict({**spec.to_dict(), "data": vars(data)})


@pytest.fixture(scope="module")
def reference(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> Events:
    spec = with_data(reference_spec(parity_spec(STEPS)), tiny_data)
    return launch(spec, tmp_path_factory.mktemp("reference"), TIMEOUT)


def assert_parity(layout: dict[str, Any], reference: Events, data: DataConfig, tmp_path: Path) -> None:
    spec = with_data(parity_spec(STEPS, **layout), data)
    parity = Parity(reference=reference, parallel=launch(spec, tmp_path, TIMEOUT))
    assert sorted(step_values(parity.parallel)) == list(range(1, STEPS + 1))
    assert parity.max_delta("loss") <= TOLERANCE, parity
    # The clipping norm is global over every tp, pp and dp shard, or it would differ here.
    assert parity.max_delta("grad_norm", relative=True) <= TOLERANCE, parity


def test_data_parallel_matches_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"dp": 2}, reference, tiny_data, tmp_path)


def test_tensor_parallel_matches_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"tp": 2}, reference, tiny_data, tmp_path)


def test_pipeline_1f1b_matches_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"pp": 2, "schedule": "1f1b"}, reference, tiny_data, tmp_path)


def test_zero3_fsdp_matches_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"dp": 2, "zero": 3}, reference, tiny_data, tmp_path)


def test_full_recompute_matches_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"dp": 2, "recompute": "full"}, reference, tiny_data, tmp_path)


def test_selective_recompute_with_tensor_parallel_matches_one_process(
    reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    assert_parity({"tp": 2, "recompute": "selective"}, reference, tiny_data, tmp_path)


def test_interleaved_1f1b_with_two_stages_per_rank_matches_one_process(
    reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    assert_parity({"pp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2}, reference, tiny_data, tmp_path)


@pytest.mark.slow
def test_data_and_tensor_parallel_match_one_process(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    assert_parity({"dp": 2, "tp": 2}, reference, tiny_data, tmp_path)


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_match_one_process(
    reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    assert_parity({"tp": 2, "pp": 2}, reference, tiny_data, tmp_path)


@pytest.mark.slow
def test_replicated_data_parallel_with_a_gpipe_pipeline_matches_one_process(
    reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    # zero=0 all-reduces in backward hooks, which must wait for every micro-batch's gradient.
    assert_parity({"dp": 2, "pp": 2, "schedule": "gpipe", "recompute": "selective"}, reference, tiny_data, tmp_path)


@pytest.mark.slow
def test_dp_tp_pp_on_eight_ranks_with_zero3_and_recompute_matches_one_process(
    reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    layout = {"dp": 2, "tp": 2, "pp": 2, "zero": 3, "recompute": "full"}
    assert_parity(layout, reference, tiny_data, tmp_path)


def test_zero2_with_gradient_accumulation_matches_one_process(tiny_data: DataConfig, tmp_path: Path) -> None:
    spec = with_data(parity_spec(STEPS, dp=2, zero=2), tiny_data)
    spec.train.grad_accum = 2
    parity = check_parity(spec, tmp_path, TIMEOUT)
    assert parity.max_delta("loss") <= TOLERANCE, parity
    assert parity.max_delta("grad_norm", relative=True) <= TOLERANCE, parity


def test_bf16_autocast_trains_close_to_fp32(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    spec = with_data(reference_spec(parity_spec(STEPS, precision="bf16")), tiny_data)
    assert spec.layout.precision == "bf16"
    parity = Parity(reference=reference, parallel=launch(spec, tmp_path, TIMEOUT))
    # bf16 keeps 8 bits of mantissa: close to fp32, but not within the fp32 tolerance.
    assert 0 < parity.max_delta("loss") <= 2e-2, parity


def test_bf16_under_zero3_fsdp_trains_close_to_fp32(reference: Events, tiny_data: DataConfig, tmp_path: Path) -> None:
    # FSDP's mixed precision (bf16 gathers, fp32 reduce-scatter) instead of autocast.
    spec = with_data(parity_spec(STEPS, dp=2, zero=3, precision="bf16"), tiny_data)
    parity = Parity(reference=reference, parallel=launch(spec, tmp_path, TIMEOUT))
    assert 0 < parity.max_delta("loss") <= 2e-2, parity
