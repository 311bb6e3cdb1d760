"""Checkpoints on local disk against checkpoints on S3, for the `small` recipe, in one run.

    python -m bench.storage [--repeats 3]

One process (a one-rank gloo group, as a rank of a run has), the `small` model (≈ 20M parameters)
and its AdamW state after one step, saved by Fathom's `Checkpointer` to a local folder and to a
real S3 server (moto's, started here on a loopback port; s3fs as the client). Medians of
`repeats` saves and loads of each:

* save time: a synchronous save (`train.async_checkpoint` off) until it is committed;
* save_stall_ms: with async saves on (the default), how long the training loop waits: the
  `save()` call plus the wait for staging before the next optimizer step, after a forward and
  backward pass that overlaps the copy (what `Trainer.fit` does);
* async_save_s: from `save()` until the background write is committed;
* load time: a resume's `load()` of the newest checkpoint.

The last line is key=value, with `s3_over_local_save` and `s3_over_local_stall` (target: the loop
waits ≤ 1.5× as long for S3 as for local disk). moto keeps objects in the memory of one Python
process on this host: it measures Fathom's path through fsspec and DCP, not a network to AWS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from tools.s3_server import S3Server
from training.checkpoint import Checkpointer
from training.config import DataConfig, RunSpec, small
from training.data import prepare_data
from training.model import Transformer, cross_entropy_loss
from training.trainer import build_optimizer

# Batch of the forward/backward pass that runs while an async save copies the state (the
# `small` recipe's micro-batch on one rank would take seconds on 2 cores; 2 sequences suffice
# to overlap the copy as a real step does).
_OVERLAP_BATCH = 2


def _median(samples: list[float]) -> float:
    return statistics.median(samples)


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _train_step(model: Transformer, optimizer: torch.optim.Optimizer, spec: RunSpec) -> None:
    tokens = torch.randint(0, spec.model.vocab_size, (_OVERLAP_BATCH, spec.model.seq_len + 1))
    loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()


def _measure(
    name: str, storage: str, run_dir: Path, spec: RunSpec, tokenizer_dir: Path, repeats: int
) -> dict[str, float]:
    torch.manual_seed(0)
    model = Transformer(spec.model)
    optimizer = build_optimizer(model, spec.train)
    _train_step(model, optimizer, spec)
    optimizer.step()  # AdamW's state exists from here: it is two thirds of a checkpoint
    optimizer.zero_grad(set_to_none=True)

    def checkpointer(async_save: bool) -> Checkpointer:
        spec.train.async_checkpoint = async_save
        return Checkpointer(
            run_dir=run_dir, parts=[model], optimizers=[optimizer], spec=spec, tokenizer_dir=tokenizer_dir,
            rank=0, hooks=[], storage=storage,
        )  # fmt: skip

    trainer_state = {"sampler": {"consumed": 0}}
    step = 0
    sync = checkpointer(False)
    save_s: list[float] = []
    for _ in range(repeats):
        step += 1
        save_s.append(_timed(partial(sync.save, step, trainer_state)))
    load_s = [_timed(partial(sync.load, step)) for _ in range(repeats)]
    sync.close()

    background = checkpointer(True)
    stall_s: list[float] = []
    async_s: list[float] = []
    for _ in range(repeats):
        step += 1
        started = time.perf_counter()
        background.save(step, trainer_state)
        called = time.perf_counter() - started
        _train_step(model, optimizer, spec)  # the next step's forward and backward overlap the copy
        stall_s.append(called + _timed(background.wait_for_staging))
        background.wait()
        async_s.append(time.perf_counter() - started)
        optimizer.zero_grad(set_to_none=True)
    background.close()
    figures = {
        f"{name}_save_s": _median(save_s),
        f"{name}_save_stall_ms": 1000 * _median(stall_s),
        f"{name}_async_save_s": _median(async_s),
        f"{name}_load_s": _median(load_s),
    }
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()), flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = small()
    spec.train.keep_checkpoints = 2 * args.repeats + 1  # pruning is not what is measured
    with tempfile.TemporaryDirectory(prefix="fathom-bench-storage-") as tmp:
        work = Path(tmp)
        dist.init_process_group("gloo", store=dist.FileStore(str(work / "store"), 1), rank=0, world_size=1)
        server = S3Server(log_file=work / "moto.log")
        server.start()
        try:
            os.environ.update(server.env())
            tokenizer_dir = prepare_data(DataConfig(), 512, 64, work / "data").tokenizer_dir
            params = sum(p.numel() for p in Transformer(spec.model).parameters())
            print(f"small: {params / 1e6:.1f}M parameters, model + AdamW state ≈ {12 * params / 2**20:.0f} MiB", flush=True)
            local = _measure("local", "", work / "runs" / "bench", spec, tokenizer_dir, args.repeats)
            s3 = _measure("s3", server.url("bench"), work / "runs" / "bench", spec, tokenizer_dir, args.repeats)
        finally:
            server.stop()
            dist.destroy_process_group()
    figures = {
        **local,
        **s3,
        "s3_over_local_save": s3["s3_save_s"] / local["local_save_s"],
        "s3_over_local_stall": s3["s3_save_stall_ms"] / local["local_save_stall_ms"],
        "s3_over_local_load": s3["s3_load_s"] / local["local_load_s"],
    }
    print("clock=wall " + " ".join(f"{k}={v:.3f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
