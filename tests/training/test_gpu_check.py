"""`python -m tools.gpu_check --rehearse` runs every part of the GPU check end to end on the CPU.

The check itself is meant for a lent GPU, where device time is scarce; this rehearsal is what
makes sure the script works before any of it is spent (docs/gpu.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.check_parity import REPO_ROOT
from tools.gpu_check import PART_KEYS, PARTS

TIMEOUT = 300  # seconds; the rehearsal's own budget is 240


@pytest.mark.slow
def test_the_rehearsal_runs_every_part_and_reports_each_figure(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    result = subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", "--rehearse", "--out", str(out), "--work", str(tmp_path / "work")],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == "rehearsal=ok", result.stdout + result.stderr
    summary = dict(pair.split("=", 1) for pair in lines[-2].split())
    assert summary["mode"] == "rehearsal"
    for part in PARTS:
        assert summary[part] == "ok", (part, summary[part], result.stderr)
        for key in PART_KEYS[part]:
            assert summary[key] not in ("", "na") and not summary[key].startswith("error"), (key, summary)
    assert summary["gpu_resume_bitwise"] == "1"
    # The CPU run against itself: the same kernels give the same losses.
    assert float(summary["parity_fp32_max_dloss"]) == 0.0
    assert float(summary["layouts_max_dloss"]) <= 1e-4
    assert (out / "summary.txt").read_text().strip() == lines[-2]
    for part in PARTS:
        assert (out / f"{part}.json").is_file()
