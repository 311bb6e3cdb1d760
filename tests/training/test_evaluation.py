"""Held-out evaluation: a fixed set of validation batches gives the same loss under every layout.

Layout runs are real torchrun launches on gloo, compared with one process on the same data and
seed (like test_parity.py); the spec checks and the split need no processes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tools.check_parity import launch, parity_spec, reference_spec
from training.config import DataConfig, RunSpec, SpecError
from training.data import TokenWindows, prepare_data
from training.trainer import training_and_held_out

STEPS = 4
TOLERANCE = 1e-4  # fp32 on CPU, as the training-loss parity
TIMEOUT = 600
Events = list[dict[str, Any]]


def evaluated_spec(data: DataConfig, **layout: Any) -> RunSpec:
    spec = parity_spec(STEPS, **layout).to_dict()
    spec["data"] = {**vars(data), "validation_fraction": 0.1}
    spec["train"].update(eval_interval=2, eval_batches=2)
    return RunSpec.from_dict(spec)


def eval_losses(events: Events) -> dict[int, float]:
    return {e["step"]: e["eval_loss"] for e in events if e["kind"] == "eval"}


@pytest.fixture(scope="module")
def reference(tiny_data: DataConfig, tmp_path_factory: pytest.TempPathFactory) -> Events:
    return launch(reference_spec(evaluated_spec(tiny_data)), tmp_path_factory.mktemp("reference"), TIMEOUT)


def test_a_run_evaluates_every_interval_and_at_its_last_step(reference: Events) -> None:
    evals = [e for e in reference if e["kind"] == "eval"]
    assert [e["step"] for e in evals] == [2, 4]
    for e in evals:
        assert e["eval_tokens"] == 2 * 8 * 64  # eval_batches × global_batch × seq_len, no prompt masked
        assert math.isclose(e["eval_perplexity"], math.exp(e["eval_loss"]), rel_tol=1e-9)
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"]  # it learns what it never saw, a little
    checkpoints = [e for e in reference if e["kind"] == "checkpoint"]
    assert checkpoints and checkpoints[-1]["step"] == STEPS
    assert checkpoints[-1]["eval_loss"] == evals[-1]["eval_loss"]


@pytest.mark.parametrize(
    "layout",
    [
        {"dp": 2, "zero": 3, "recompute": "full"},
        {"tp": 2},
        {"pp": 2, "schedule": "1f1b"},
        {"pp": 2, "schedule": "interleaved_1f1b", "stages_per_rank": 2},
        pytest.param({"dp": 2, "tp": 2, "pp": 2, "zero": 3}, marks=pytest.mark.slow),
        pytest.param({"dp": 2, "pp": 2, "schedule": "gpipe"}, marks=pytest.mark.slow),
    ],
    ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()),
)
def test_the_eval_loss_is_the_same_under_every_layout(
    layout: dict[str, Any], reference: Events, tiny_data: DataConfig, tmp_path: Path
) -> None:
    parallel = eval_losses(launch(evaluated_spec(tiny_data, **layout), tmp_path, TIMEOUT))
    expected = eval_losses(reference)
    assert parallel.keys() == expected.keys() == {2, 4}
    assert max(abs(parallel[s] - expected[s]) for s in expected) <= TOLERANCE, (parallel, expected)


def test_eval_interval_without_held_out_data_is_refused_naming_the_field() -> None:
    with pytest.raises(SpecError) as caught:
        RunSpec.from_dict({"train": {"eval_interval": 10}})
    assert caught.value.field == "train.eval_interval"
    assert "validation_fraction" in caught.value.message


@pytest.mark.parametrize("fraction", [-0.1, 0.75, True, "a tenth"])
def test_a_validation_fraction_outside_zero_to_a_half_is_refused_naming_the_field(fraction: Any) -> None:
    with pytest.raises(SpecError) as caught:
        RunSpec.from_dict({"data": {"validation_fraction": fraction}})
    assert caught.value.field == "data.validation_fraction"


@pytest.mark.parametrize(("train", "field"), [({"eval_interval": -1}, "train.eval_interval"),
                                               ({"eval_batches": 0}, "train.eval_batches"),
                                               ({"steps": 10, "eval_interval": 11}, "train.eval_interval")])
def test_bad_eval_settings_are_refused_naming_the_field(train: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as caught:
        RunSpec.from_dict({"train": {"warmup_steps": 0, **train}, "data": {"validation_fraction": 0.1}})
    assert caught.value.field == field


def test_a_held_out_fraction_is_never_trained_on() -> None:
    tokens = np.arange(1001, dtype=np.uint16)
    train, held = TokenWindows(tokens, 10).split(0.2)
    assert (train.num_samples, held.num_samples) == (80, 20)
    _, train_targets = train.batch(np.arange(train.num_samples))
    held_inputs, _ = held.batch(np.arange(held.num_samples))
    assert train_targets.max().item() == 800  # the last target training reads: the held-out part's first token
    assert held_inputs.min().item() == 800 and held_inputs.max().item() == 999


def test_a_second_dataset_is_held_out_with_the_runs_tokenizer(tiny_data: DataConfig, tmp_path: Path) -> None:
    held_out = tmp_path / "held-out.txt"
    held_out.write_text("The keeper of the lighthouse counted the boats twice.\n\n" * 40)
    spec = evaluated_spec(tiny_data).to_dict()
    spec["data"] = {**vars(tiny_data), "validation_dataset": str(held_out)}
    run = RunSpec.from_dict(spec)
    prepared = prepare_data(run.data, run.model.vocab_size, run.model.seq_len, tmp_path / "work")
    train, held = training_and_held_out(prepared, run)
    assert held is not None
    assert train.num_samples == prepared.windows(run.model.seq_len).num_samples  # all of the dataset trains
    assert 0 < held.num_samples < train.num_samples
    assert prepared.validation_tokens_path != prepared.tokens_path
