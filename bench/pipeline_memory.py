"""Peak memory of the last pipeline stage under 1F1B: logits are dropped after each micro-batch.

    python -m bench.pipeline_memory

Two ranks (torchrun, gloo, one thread each) train two steps of a 2-layer model cut into pp=2
stages, 1F1B over 16 micro-batches, with a 16,384-token vocabulary so that each micro-batch's
logits (2 × 256 × 16,384 fp32 = 32 MiB) dominate the last stage. If the schedule returned its
outputs, all 16 would stay alive to the end of the step (512 MiB); with `return_outputs=False`
(the trainer's) at most the in-flight ones are. Both are measured in the same run, each in fresh
ranks: "before" is the same trainer with its schedule made to return its outputs again, as it
did before that change.

Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MICROBATCHES = 16
VOCAB = 16384
SEQ = 256
GLOBAL_BATCH = 32


def worker(tokenizer: str, work_dir: Path, mode: str) -> None:
    import torch
    import torch.distributed as dist

    from training.config import LayoutConfig, ModelConfig, RunSpec, TrainConfig
    from training.data import prepare_data
    from training.metrics import peak_memory_mb
    from training.trainer import Trainer

    torch.set_num_threads(1)
    spec = RunSpec(
        model=ModelConfig(n_layers=2, dim=64, n_heads=2, n_kv_heads=2, vocab_size=VOCAB, seq_len=SEQ),
        layout=LayoutConfig(pp=2, schedule="1f1b", microbatches=MICROBATCHES),
        train=TrainConfig(steps=3, warmup_steps=1, global_batch=GLOBAL_BATCH, checkpoint_interval=100),
    )
    spec = RunSpec.from_dict({**spec.to_dict(), "data": {"tokenizer": tokenizer}})
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    data = prepare_data(spec.data, VOCAB, SEQ, work_dir / f"data{rank}")
    trainer = Trainer(spec=spec, run_dir=work_dir / f"{mode}-run{rank}", data=data, rank=rank, world_size=2)
    schedule = trainer.model.schedule
    if mode == "before" and schedule is not None:
        original_step = schedule.step
        schedule.step = lambda *a, **kw: original_step(*a, **{**kw, "return_outputs": True})  # type: ignore[method-assign]
    setup = peak_memory_mb()
    for step in (1, 2):
        trainer.train_step(step)
    if trainer.model.has_last_stage:
        print("RESULT " + json.dumps({"setup_mb": setup, "peak_mb": peak_memory_mb()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=3, metavar=("TOKENIZER", "WORK_DIR", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]), args.worker[2])
        return

    from training.config import DataConfig
    from training.data import prepare_data

    with tempfile.TemporaryDirectory(prefix="fathom-pipeline-memory-") as tmp:
        work = Path(tmp)
        tokenizer = prepare_data(DataConfig(), 512, SEQ, work / "shared").tokenizer_dir / "tokenizer.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        result = {mode: last_stage(tokenizer, work, mode, env) for mode in ("after", "before")}
    logits_mb = MICROBATCHES * (GLOBAL_BATCH // MICROBATCHES) * SEQ * VOCAB * 4 / 2**20
    now, then = result["after"], result["before"]
    print(f"last stage: {now['setup_mb']:.0f} MiB after setup, {now['peak_mb']:.0f} MiB peak over two steps")
    print(f"before (the schedule returns its outputs): {then['peak_mb']:.0f} MiB peak, measured in this run")
    print(f"all {MICROBATCHES} micro-batches' logits together would be {logits_mb:.0f} MiB")
    print(
        f"last_stage_peak_mb={now['peak_mb']:.0f} before_peak_mb={then['peak_mb']:.0f} setup_mb={now['setup_mb']:.0f} "
        f"all_logits_mb={logits_mb:.0f} microbatches={MICROBATCHES}"
    )


def last_stage(tokenizer: Path, work: Path, mode: str, env: dict[str, str]) -> dict[str, float]:
    """The last stage's memory figures from two fresh ranks training in `mode` ("after" or "before")."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    command += ["-m", "bench.pipeline_memory", "--worker", str(tokenizer), str(work), mode]
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the ranks ({mode}) failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result: dict[str, float] = json.loads(lines[0].removeprefix("RESULT "))
    return result


if __name__ == "__main__":
    main()
