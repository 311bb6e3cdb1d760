"""The planner's entry points: the search and its explanation, /api/plan's function, the CLI, the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.config import SpecError
from training.planner.hardware import DEVICES, Cluster
from training.planner.model_shapes import model_preset
from training.planner.paper_report import report
from training.planner.search import plan, plan_query

REPO = Path(__file__).resolve().parents[2]


def run_plan(*args: str, module: str = "training.planner") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_it_ranks_the_layouts_that_fit_by_step_time_and_explains_the_winner() -> None:
    result = plan(model_preset("70b"), Cluster(device=DEVICES["h100"], nodes=128, devices_per_node=8), 1024)
    times = [e.step_seconds for e in result.ranked]
    assert times == sorted(times)
    assert all(e.fits for e in result.ranked) and not any(e.fits for e in result.too_big)
    best = result.ranked[0]
    text = result.explain()
    assert best.label in text and "Why each setting" in text
    assert "tp=16: refused: layout.tp: must divide model.n_kv_heads; got tp=16, n_kv_heads=8" in text
    assert "does not fit: needs" in text
    assert all(r.reason for r in result.rejected)


def test_plan_query_takes_the_query_strings_of_api_plan() -> None:
    out = plan_query(
        {"model": "tiny", "nodes": "1", "gpus_per_node": "2", "gpu": "cpu", "global_batch": "8", "top": "3"}
    )
    json.dumps(out)  # JSON-ready as it is
    assert out["precision"] == "fp32" and out["cluster"]["world_size"] == 2
    assert 0 < len(out["ranked"]) <= 3
    first = out["ranked"][0]
    assert {"label", "memory", "dp", "tp", "pp", "step_seconds", "mfu", "bubble_fraction"} <= set(first)
    assert out["explanation"].startswith("Best of")


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ({"nodes": "x", "global_batch": "8"}, "nodes"),
        ({"nodes": "1"}, "global_batch"),
        ({"nodes": "1", "global_batch": "8", "gpu": "tpu"}, "gpu"),
        ({"nodes": "1", "global_batch": "8", "model": "7b"}, "model"),
    ],
)
def test_plan_query_names_the_parameter_it_refuses(query: dict[str, str], field: str) -> None:
    with pytest.raises(SpecError) as err:
        plan_query(query)
    assert err.value.field == field


def test_the_cli_prints_a_ranked_table_and_the_reasons() -> None:
    proc = run_plan(
        "--model",
        "70b",
        "--nodes",
        "128",
        "--gpus-per-node",
        "8",
        "--gpu",
        "h100",
        "--global-batch",
        "1024",
        "--top",
        "3",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#  layout"))
    assert [line.split()[0] for line in lines[header + 1 : header + 4]] == ["1", "2", "3"]
    assert "Why each setting:" in proc.stdout and "Turned down (most frequent reasons):" in proc.stdout


def test_the_cli_prints_json_and_refuses_bad_values() -> None:
    proc = run_plan(
        "--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "8", "--json"
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["counts"]["fit"] > 0
    bad = run_plan("--model", "tiny", "--nodes", "0", "--global-batch", "8")
    assert bad.returncode == 2 and "nodes: must be a positive integer" in bad.stderr


def test_the_committed_report_is_what_the_command_writes() -> None:
    text = report()
    for title in ("## Llama 3 8B", "## Llama 3 70B", "## Llama 3 405B", "## What this says", "## Sources"):
        assert title in text
    assert "arXiv:2407.21783" in text and "llama3_h100_202412_torchtitan.md" in text
    assert (REPO / "docs" / "planning.md").read_text() == text, (
        "run: python -m training.planner report --write docs/planning.md"
    )


def test_a_measured_cpu_device_file_drives_the_planner(tmp_path: Path) -> None:
    device_file = tmp_path / "cpu.json"
    env_cmd = [sys.executable, "-m", "training.planner.calibrate", "--ranks", "2", "--out", str(device_file)]
    proc = subprocess.run(env_cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    measured = json.loads(device_file.read_text())
    assert measured["peak_tflops_fp32"] > 0 and measured["intra_node_gbps"] > 0
    planned = run_plan(
        "--model",
        "tiny",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--device-file",
        str(device_file),
        "--precision",
        "fp32",
        "--global-batch",
        "8",
        "--json",
    )
    assert planned.returncode == 0, planned.stderr
    assert json.loads(planned.stdout)["cluster"]["device"]["name"] == measured["name"]


def test_the_planner_imports_without_torch_so_the_control_plane_can_call_it() -> None:
    code = (
        "import sys, training.planner.search, training.planner.cli, training.plan, training.run_dir; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_the_earlier_command_name_runs_the_same_planner() -> None:
    query = ("--model", "tiny", "--nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu", "--global-batch", "8", "--json")
    earlier, now = run_plan(*query, module="training.plan"), run_plan(*query)
    assert earlier.returncode == now.returncode == 0, earlier.stderr + now.stderr
    assert json.loads(earlier.stdout) == json.loads(now.stdout)
