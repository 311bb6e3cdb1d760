"""The seeded init of a meta-built model gives today's eager weights, bit for bit, under any layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.check_parity import REPO_ROOT, rank_environment
from training.config import ModelConfig, RunSpec, tiny
from training.initial_weights import SeededInit, build_meta, materialize, slabs
from training.model import Transformer

TIMEOUT = 300  # seconds; a hung launch fails its test instead of blocking the suite


@pytest.mark.parametrize("shape", [(1000, 37), (130, 7), (3, 5), (17,), (4096, 24)])
@pytest.mark.parametrize("kind", ["normal_", "uniform_"])
def test_drawing_a_tensor_in_slabs_draws_what_drawing_it_whole_does(
    shape: tuple[int, ...], kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("training.initial_weights.SLAB_ELEMENTS", 2000)  # many slabs, some with a tail
    torch.manual_seed(7)
    whole = getattr(torch.empty(shape), kind)()
    next_whole = torch.rand(4)
    torch.manual_seed(7)
    pieces = [rows for _, rows in slabs(shape, lambda t: getattr(t, kind)())]
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(torch.rand(4), next_whole)  # the generator ends where it ended


def assert_materialized_is_eager(cfg: ModelConfig, seed: int) -> Transformer:
    """A model built on meta and filled by `SeededInit(cfg, seed)` holds every parameter and
    buffer `torch.manual_seed(seed); Transformer(cfg)` holds, and leaves the generator where
    that leaves it; returns the eager model."""
    torch.manual_seed(seed)
    eager = Transformer(cfg)
    next_eager = torch.rand(4)
    model = build_meta(cfg)
    materialize([model], torch.device("cpu"), SeededInit(cfg, seed=seed))
    assert torch.equal(torch.rand(4), next_eager)
    for (name, a), (_, b) in zip(eager.named_parameters(), model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(eager.named_buffers(), model.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    return eager


def test_a_materialized_model_is_the_eager_model_of_the_same_seed() -> None:
    assert_materialized_is_eager(tiny().model, seed=3)


def materialize_under(spec: RunSpec, tmp_path: Path) -> list[dict[str, Any]]:
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(spec.to_json())
    nproc = spec.layout.world_size
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(Path(__file__).with_name("materialize_rank.py")),
        str(spec_file),
        str(tmp_path),
    ]
    env = rank_environment(tmp_path / "events.jsonl")
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]


def uneven_fsdp() -> RunSpec:
    """FSDP over 4 ranks of a vocabulary (258 rows) that does not split evenly: chunks 65, 65, 65, 63."""
    spec = tiny(dp=4, zero=3)
    spec.model = ModelConfig(**{**vars(spec.model), "vocab_size": 258})
    return spec


@pytest.mark.parametrize(
    "spec",
    [
        tiny(dp=2, tp=2, zero=3, recompute="full"),
        tiny(tp=2, pp=2, microbatches=2),
        tiny(pp=2, schedule="interleaved_1f1b", stages_per_rank=2, microbatches=4),
        uneven_fsdp(),
    ],
    ids=["dp2-tp2-zero3-recompute", "tp2-pp2", "pp2-interleaved", "dp4-zero3-uneven"],
)
def test_every_layout_starts_from_the_eager_weights(spec: RunSpec, tmp_path: Path) -> None:
    reports = materialize_under(spec, tmp_path)
    assert all(r["differ"] == [] for r in reports), [r["differ"] for r in reports]
    assert all(r["generator_in_step"] for r in reports)
    held = {name for r in reports for name in r["held"]}
    assert held == {name for name, _ in build_meta(spec.model).named_parameters()}
