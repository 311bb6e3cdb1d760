"""Does a parallel layout train exactly like one process? Runs both and compares per-step losses.

    python -m tools.check_parity --dp 2 --tp 2 --pp 2 --zero 3 --steps 5

launches the layout under torchrun (gloo, one thread per rank) and a single-process reference on
the same data, tokenizer and seed (the `tiny` recipe), and prints `max |Δloss| = …` last.
The functions here are also what the tests call.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import DataConfig, RunSpec, tiny
from training.data import prepare_data
from training.rank_events import read_events
from training.run_dir import RunDir

REPO_ROOT = Path(__file__).resolve().parents[1]


def rank_environment(events_file: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    env["OMP_NUM_THREADS"] = "1"  # ranks share few cores; more threads per rank only contend
    # Fresh rendezvous keys on every launch; reused ones made restarts fail (see TORCH-ON-CPU.md).
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env["FATHOM_EVENTS_FILE"] = str(events_file)
    return env


def launch(spec: RunSpec, run_dir: Path, timeout: float = 600.0) -> list[dict[str, Any]]:
    """Runs `training.train` on `spec` in `run_dir` (torchrun if the layout has >1 rank); returns its events."""
    run_dir.mkdir(parents=True, exist_ok=True)
    folder = RunDir(run_dir)
    spec_file = folder.spec_file
    spec_file.write_text(spec.to_json())
    nproc = spec.layout.world_size
    prefix = [sys.executable]
    if nproc > 1:
        prefix += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command = [*prefix, "-m", "training.train", "--spec", str(spec_file), "--run-dir", str(run_dir)]
    events_file = folder.events_file
    log = folder.standalone_log
    with log.open("w") as out:
        result = subprocess.run(
            command,
            cwd=REPO_ROOT,
            env=rank_environment(events_file),
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        )
    if result.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise RuntimeError(f"{' '.join(command)} exited with {result.returncode}:\n{tail}")
    return read_events(events_file)


def step_values(events: list[dict[str, Any]], key: str = "loss") -> dict[int, float]:
    """`key` of every metrics event, by step."""
    return {e["step"]: e[key] for e in events if e["kind"] == "metrics"}


def shared_data(work_dir: Path, spec: RunSpec) -> DataConfig:
    """One corpus and tokenizer for every run compared, prepared once."""
    prepared = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, work_dir / "shared-data")
    dataset = spec.data.dataset or str(work_dir / "shared-data" / "demo.txt")
    return DataConfig(dataset=dataset, tokenizer=str(prepared.tokenizer_dir / "tokenizer.json"))


def parity_spec(steps: int = 5, **layout: Any) -> RunSpec:
    """The tiny recipe on `layout`; 1F1B-style schedules get one micro-batch per pipeline stage."""
    pp = layout.get("pp", 1)
    if pp > 1:
        layout.setdefault("microbatches", pp * layout.get("stages_per_rank", 1))
    spec = tiny(**layout)
    spec.train.steps = steps
    spec.train.warmup_steps = min(spec.train.warmup_steps, steps)
    spec.train.checkpoint_interval = steps
    return spec


def reference_spec(spec: RunSpec) -> RunSpec:
    """The same run on one process: same model, data, seed and global batch; no parallelism."""
    return RunSpec.from_dict(
        {**spec.to_dict(), "layout": {"precision": spec.layout.precision}, "nodes": {}, "faults": []}
    )


@dataclass(frozen=True)
class Parity:
    reference: list[dict[str, Any]]  # events of the single-process run
    parallel: list[dict[str, Any]]  # events of the parallel run

    def max_delta(self, key: str = "loss", relative: bool = False) -> float:
        """Largest per-step |reference − parallel| of a metric (loss, grad_norm), optionally / |reference|."""
        ref, par = step_values(self.reference, key), step_values(self.parallel, key)
        if ref.keys() != par.keys():
            raise ValueError(f"steps differ: reference {sorted(ref)}, parallel {sorted(par)}")
        return max(abs(ref[s] - par[s]) / (abs(ref[s]) if relative else 1.0) for s in ref)


def check_parity(spec: RunSpec, work_dir: Path, timeout: float = 600.0) -> Parity:
    spec = RunSpec.from_dict({**spec.to_dict(), "data": vars(shared_data(work_dir, spec))})
    reference = launch(reference_spec(spec), work_dir / "reference", timeout)
    return Parity(reference=reference, parallel=launch(spec, work_dir / "parallel", timeout))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.check_parity", description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3))
    parser.add_argument("--recompute", default="none", choices=("none", "selective", "full"))
    parser.add_argument("--schedule", default="1f1b", choices=("gpipe", "1f1b", "interleaved_1f1b"))
    parser.add_argument("--stages-per-rank", type=int, default=1, help="virtual stages (interleaved_1f1b)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    spec = parity_spec(
        args.steps,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        zero=args.zero,
        recompute=args.recompute,
        schedule=args.schedule,
        stages_per_rank=args.stages_per_rank,
    )
    with tempfile.TemporaryDirectory(prefix="fathom-parity-") as tmp:
        parity = check_parity(spec, args.work_dir or Path(tmp))
    ref, par = step_values(parity.reference), step_values(parity.parallel)
    for step in sorted(ref):
        print(f"step {step}: reference loss {ref[step]:.7f}  parallel {par.get(step, float('nan')):.7f}")
    print(f"max |Δgrad_norm| / grad_norm = {parity.max_delta('grad_norm', relative=True):.3e}")
    print(f"max |Δloss| = {parity.max_delta():.3e}")


if __name__ == "__main__":
    main()
