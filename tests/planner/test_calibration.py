"""The planner against Fathom's real trainer: torchrun ranks on gloo, step 2 measured (calibration.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from calibration import CASES, TOLERANCE, compare, run_cases, table, unknown_collectives


@pytest.mark.slow
def test_predicted_memory_and_traffic_are_within_15_percent_of_the_trainers(tmp_path: Path) -> None:
    names = list(CASES)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run_cases(names, out_dir, tmp_path / "data", timeout=600)
    assert unknown_collectives(names, out_dir) == {}
    rows = [row for name in names for row in compare(name, out_dir)]
    print(table(rows))
    quantities = {(r.case, r.quantity) for r in rows}
    for name in names:  # every case measured its states, activations and its own dimension's traffic
        assert {(name, "weights"), (name, "grads"), (name, "optimizer"), (name, "activations")} <= quantities
    off = [r for r in rows if r.error > TOLERANCE]
    assert not off, table(off)
