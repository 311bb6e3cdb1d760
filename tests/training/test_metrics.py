"""What rank 0 reports: its per-step log line, and MFU counted as the model computes."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from training.config import DataConfig, ModelConfig, RunSpec, tiny
from training.data import prepare_data
from training.metrics import flops_per_token, mfu, step_line
from training.model import Transformer, cross_entropy_loss
from training.trainer import Trainer

GQA = ModelConfig(n_layers=3, dim=96, n_heads=6, n_kv_heads=2, vocab_size=512, seq_len=40)


def test_a_step_line_names_every_metric_with_its_unit() -> None:
    metrics = {
        "step": 12,
        "loss": 3.45123,
        "lr": 0.00291,
        "grad_norm": 0.8123,
        "tokens_per_s": 5120.4,
        "mfu": 0.4123,
        "step_time": 0.2104,
        "memory_mb": 812.3,
    }
    assert step_line(metrics, 200) == (
        "step 12/200 loss 3.4512 lr 2.9e-03 grad_norm 0.812 tok/s 5120 mfu 41.2% step 0.21s mem 812MB"
    )


def matmul_flops_of_a_training_step(cfg: ModelConfig, batch: int) -> int:
    """What torch counts for the model's forward and backward: its weight matmuls (it does not
    count the fused attention kernel)."""
    model = Transformer(cfg)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len))
    with FlopCounterMode(display=False) as counter:
        cross_entropy_loss(model(ids), ids).backward()
    return counter.get_total_flops()


def unmasked_attention_flops(cfg: ModelConfig, batch: int) -> int:
    """torch's count of one layer's score and value matmuls, forward and backward, without a mask."""
    shape = (batch, cfg.n_heads, cfg.seq_len, cfg.head_dim)  # every query head reads its kv head's keys
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        y = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v  # (B, heads, T, head_dim)
        y.sum().backward()
    return counter.get_total_flops()


def test_the_weight_flops_are_what_torch_counts_for_the_models_matmuls() -> None:
    cfg, batch = GQA, 2
    attention = 6 * cfg.n_layers * cfg.dim * cfg.seq_len
    assert (flops_per_token(cfg) - attention) * batch * cfg.seq_len == matmul_flops_of_a_training_step(cfg, batch)


def test_causal_attention_counts_half_of_the_unmasked_score_and_value_matmuls() -> None:
    cfg, batch = GQA, 2
    weights = matmul_flops_of_a_training_step(cfg, batch) / (batch * cfg.seq_len)
    per_layer = unmasked_attention_flops(cfg, batch) / (batch * cfg.seq_len)
    assert flops_per_token(cfg) - weights == cfg.n_layers * per_layer / 2


def test_mfu_is_the_models_flops_per_second_over_the_peak() -> None:
    cfg = tiny().model
    assert mfu(1000.0, cfg, 4e9) == 1000.0 * flops_per_token(cfg) / 4e9
    assert mfu(1000.0, cfg, 0.0) == 0.0  # a rank that measured no peak reports none


def test_the_logged_mfu_is_the_shared_formula_over_the_runs_own_peak(tmp_path: Path, tiny_data: DataConfig) -> None:
    spec = RunSpec.from_dict({**tiny().to_dict(), "data": vars(tiny_data)})
    data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, tmp_path / "data")
    trainer = Trainer(spec=spec, run_dir=tmp_path / "run", data=data)
    (cached,) = (tmp_path / "run" / "peak_flops").iterdir()
    assert cached.name.endswith(f"-cpu-{torch.get_num_threads()}threads-fp32.json")
    first = trainer.train_step(1)
    time.sleep(0.2)  # what a save or a hook between two steps takes from the run
    second = trainer.train_step(2)
    for metrics in (first, second):
        assert metrics["mfu"] == mfu(metrics["tokens_per_s"], spec.model, trainer.peak_flops)
    assert first["tokens_per_s"] == trainer.tokens_per_step / first["step_time"]
    # The second step's throughput counts the time since the first ended, not only its own.
    assert second["tokens_per_s"] <= trainer.tokens_per_step / (second["step_time"] + 0.2)
