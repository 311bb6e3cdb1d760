"""Rank 0's per-step log line: what users read while a run trains."""

from __future__ import annotations

from training.metrics import step_line


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
