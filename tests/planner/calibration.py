"""The planner's estimates set beside what Fathom's real trainer holds and sends, on CPU with gloo.

    .venv/bin/python tests/planner/calibration.py      # runs the cases with torchrun, prints the table

Each case is a planner `Candidate`; its `RunSpec` (the very one the planner validated) goes to
torchrun ranks running `training.trainer.Trainer` (calibration_rank.py), which measure step 2:
weights, gradients and AdamW state from the tensors, the peak of forward-made storages still alive
(activations), and the bytes every collective sends, per mesh dimension. Pipeline ranks are
compared position by position (the first stage with the planner's "first", the last with "last").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from training.config import ModelConfig  # noqa: E402
from training.planner.hardware import DEVICES, Cluster  # noqa: E402
from training.planner.layout_costs import Candidate, Estimate, estimate  # noqa: E402

MODEL = ModelConfig(n_layers=4, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, seq_len=32)
GLOBAL_BATCH = 4
WORLD = 2
CLUSTER = Cluster(device=DEVICES["cpu"], nodes=1, devices_per_node=WORLD)
TOLERANCE = 0.15

CASES: dict[str, Candidate] = {
    "dp2": Candidate(dp=2, tp=1, pp=1, zero=0, recompute="none", micro_batch=1),
    "dp2_zero2": Candidate(dp=2, tp=1, pp=1, zero=2, recompute="none", micro_batch=1),
    "dp2_zero3": Candidate(dp=2, tp=1, pp=1, zero=3, recompute="none", micro_batch=1),
    "tp2": Candidate(dp=1, tp=2, pp=1, zero=0, recompute="none", micro_batch=2),
    "tp2_selective": Candidate(dp=1, tp=2, pp=1, zero=0, recompute="selective", micro_batch=2),
    "tp2_full": Candidate(dp=1, tp=2, pp=1, zero=0, recompute="full", micro_batch=2),
    "pp2": Candidate(dp=1, tp=1, pp=2, zero=0, recompute="none", micro_batch=2),
    "pp2_interleaved": Candidate(
        dp=1, tp=1, pp=2, zero=0, recompute="none", micro_batch=2, schedule="interleaved_1f1b", stages_per_rank=2
    ),
}
QUANTITIES = ("weights", "grads", "optimizer", "activations", "sent dp", "sent tp", "sent pp")


@dataclass(frozen=True)
class Row:
    case: str
    position: str  # "first" or "last" pipeline rank ("all" without a pipeline)
    quantity: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        if self.measured == 0:
            return 0.0 if self.predicted == 0 else float("inf")
        return abs(self.predicted - self.measured) / self.measured


def predict(name: str) -> Estimate:
    result = estimate(MODEL, CLUSTER, GLOBAL_BATCH, CASES[name], precision="fp32")
    assert isinstance(result, Estimate), f"{name}: the planner refuses it: {result}"
    return result


def run_cases(names: list[str], out_dir: Path, data_dir: Path, timeout: float = 900) -> None:
    """Runs the cases in one torchrun job of WORLD ranks; results land in out_dir."""
    cases = [{"name": n, "spec": CASES[n].spec(MODEL, CLUSTER, GLOBAL_BATCH, "fp32").to_dict()} for n in names]
    cases_file = out_dir / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={WORLD}",
        str(Path(__file__).with_name("calibration_rank.py")),
        str(cases_file),
        str(out_dir),
        str(data_dir),
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"calibration ranks failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )


def compare(name: str, out_dir: Path) -> list[Row]:
    est = predict(name)
    ranks = [json.loads((out_dir / f"{name}.rank{r}.json").read_text()) for r in range(WORLD)]
    cand = CASES[name]
    positions = {"first": 0, "last": cand.pp - 1} if cand.pp > 1 else {"all": 0}
    rows: list[Row] = []
    for position, pp_rank in positions.items():
        measured = [r for r in ranks if r["coords"]["pp"] == pp_rank]
        memory = est.stage_memory["first" if position == "all" else position]
        for quantity in ("weights", "grads", "optimizer"):
            rows.append(Row(name, position, quantity, getattr(memory, quantity), max(r[quantity] for r in measured)))
        # The measured peak is sampled after every forward op, so it sees the logits beside the
        # log-probabilities while the loss runs, as the planner's `logits` line says.
        predicted = memory.activations + memory.logits
        rows.append(Row(name, position, "activations", predicted, max(r["activations"] for r in measured)))
    for dim in ("dp", "tp", "pp"):
        predicted = getattr(est, dim).bytes
        measured_sent = max(r["sent"].get(dim, 0.0) for r in ranks)
        if predicted or measured_sent:
            rows.append(Row(name, "all", f"sent {dim}", predicted, measured_sent))
    return rows


def unknown_collectives(names: list[str], out_dir: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name in names:
        for r in range(WORLD):
            unknown = json.loads((out_dir / f"{name}.rank{r}.json").read_text())["unknown_collectives"]
            if unknown:
                found[f"{name}.rank{r}"] = unknown
    return found


def details(names: list[str], out_dir: Path) -> str:
    """Rank 0's traffic per collective and what else was alive at its activation peak."""
    lines = []
    for name in names:
        r0 = json.loads((out_dir / f"{name}.rank0.json").read_text())
        ops = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r0["sent_by_op"].items()))
        lines.append(f"{name}: sent {ops}; alive at peak {r0['alive_at_peak']}")
    return "\n".join(lines)


def table(rows: list[Row]) -> str:
    lines = [f"{'case':16} {'rank':5} {'quantity':12} {'predicted':>12} {'measured':>12} {'error':>7}"]
    for r in rows:
        lines.append(
            f"{r.case:16} {r.position:5} {r.quantity:12} {r.predicted:12,.0f} {r.measured:12,.0f} {r.error:7.1%}"
        )
    worst = max(rows, key=lambda r: r.error)
    lines.append(f"rows={len(rows)} max_error={worst.error:.3f} worst={worst.case}/{worst.position}/{worst.quantity}")
    return "\n".join(lines)


def main(argv: list[str]) -> dict[str, Any]:
    names = argv or list(CASES)
    with tempfile.TemporaryDirectory(prefix="planner-calibration-") as tmp:
        out_dir, data_dir = Path(tmp) / "out", Path(tmp) / "data"
        out_dir.mkdir()
        run_cases(names, out_dir, data_dir)
        rows = [row for name in names for row in compare(name, out_dir)]
        print(table(rows))
        if os.environ.get("CALIBRATION_DETAILS"):
            print(details(names, out_dir))
        unknown = unknown_collectives(names, out_dir)
        if unknown:
            print("collectives the counter does not know:", unknown)
    return {"rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
