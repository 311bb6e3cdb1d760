"""Fathom's trainer against a hand-written PyTorch loop, CPU MFU, and what recompute saves.

    python -m bench.train_throughput [--steps 4]

On the `small` recipe (≈20M parameters, seq 256, batch 16), one process, one thread:

1. tokens/s of `Trainer.train_step` (no parallelism) ÷ tokens/s of a plain loop on the same model,
   batches and optimizer (forward, cross-entropy, backward, clip, AdamW). Steps alternate between
   the two so that load from other processes on the host falls on both alike; medians are compared.
   Target ≥ 0.95: the trainer's bookkeeping must cost next to nothing.
2. MFU: the trainer's model FLOP/s over the best fp32 matmul FLOP/s measured on this thread.
   Target ≥ 50%.

The host is shared, so wall-clock step times swing with other people's load. Ratio and MFU are
therefore computed on the CPU time of this (only computing) thread, for the steps and the matmul
peak alike; wall-clock tokens/s are printed beside them.
3. Peak resident memory of a fresh process running two trainer steps with recompute none vs full.

Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from training.config import RunSpec, small
from training.data import PreparedData, TokenWindows, prepare_data
from training.metrics import measure_matmul_peak, peak_memory_mb
from training.model import Transformer, flops_per_token
from training.trainer import Trainer


def bench_spec(recompute: str = "none") -> RunSpec:
    spec = small(recompute=recompute)
    spec.train.steps = 1000  # only sets the LR schedule's length; the bench runs a few steps
    return spec


def prepare(work_dir: Path, spec: RunSpec) -> PreparedData:
    return prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, work_dir / "data")


class PlainLoop:
    """What one would write by hand: the same model, data order and AdamW, nothing else."""

    def __init__(self, spec: RunSpec, data: PreparedData) -> None:
        torch.manual_seed(spec.train.seed)
        self.model = Transformer(spec.model)
        t = spec.train
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
        self.windows = TokenWindows(data.tokens(), spec.model.seq_len)
        self.batch = t.global_batch
        self.clip = t.grad_clip
        self.generator = torch.Generator().manual_seed(t.seed)

    def step(self) -> float:
        indices = torch.randint(0, self.windows.num_samples, (self.batch,), generator=self.generator).numpy()
        x, y = self.windows.batch(indices)
        logits = self.model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.item()


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this thread's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - wall, time.thread_time() - cpu


def probe_memory(recompute: str, work_dir: Path) -> None:
    """Runs in a fresh process: two trainer steps, then prints the peak resident memory as JSON."""
    torch.set_num_threads(1)
    spec = bench_spec(recompute)
    trainer = Trainer(spec=spec, run_dir=work_dir / f"mem-{recompute}", data=prepare(work_dir, spec))
    for step in (1, 2):
        trainer.train_step(step)
    print(json.dumps({"recompute": recompute, "peak_mb": peak_memory_mb()}))


def measure_memory(recompute: str, work_dir: Path) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "bench.train_throughput", "--probe-memory", recompute, "--work-dir", str(work_dir)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train_throughput", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4, help="measured steps of each loop (after one warm-up)")
    parser.add_argument("--probe-memory", choices=("none", "selective", "full"), help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.probe_memory:
        probe_memory(args.probe_memory, args.work_dir)
        return
    with tempfile.TemporaryDirectory(prefix="fathom-bench-") as tmp:
        work_dir = Path(tmp)
        spec = bench_spec()
        data = prepare(work_dir, spec)
        trainer = Trainer(spec=spec, run_dir=work_dir / "run", data=data)
        plain = PlainLoop(spec, data)
        fathom: list[tuple[float, float]] = []
        plain_times: list[tuple[float, float]] = []
        for step in range(1, args.steps + 2):  # step 1 warms up both (allocator, thread pool)
            f = timed(lambda s=step: trainer.train_step(s))  # type: ignore[misc]
            p = timed(plain.step)
            if step > 1:
                fathom.append(f)
                plain_times.append(p)
            print(
                f"step {step}: fathom {f[0]:.2f} s wall {f[1]:.2f} s cpu, plain {p[0]:.2f} s wall {p[1]:.2f} s cpu",
                flush=True,
            )
        peak = measure_matmul_peak(seconds=2.0, clock=time.thread_time)
        tokens = spec.train.global_batch * spec.model.seq_len
        fathom_tps = tokens / statistics.median(cpu for _, cpu in fathom)
        plain_tps = tokens / statistics.median(cpu for _, cpu in plain_times)
        fathom_wall_tps = tokens / statistics.median(wall for wall, _ in fathom)
        plain_wall_tps = tokens / statistics.median(wall for wall, _ in plain_times)
        mfu = fathom_tps * flops_per_token(spec.model) / peak
        memory = {mode: measure_memory(mode, work_dir) for mode in ("none", "full")}
    print(
        f"model: small recipe, {spec.model.num_params() / 1e6:.1f}M parameters, batch {spec.train.global_batch} × seq {spec.model.seq_len}"
    )
    print(
        f"fathom trainer: {fathom_tps:,.0f} tokens per CPU-second ({fathom_wall_tps:,.0f} tokens/s wall); "
        f"plain loop: {plain_tps:,.0f} ({plain_wall_tps:,.0f} wall); ratio {fathom_tps / plain_tps:.3f} (target ≥ 0.95)"
    )
    print(f"matmul peak (1 thread, CPU time): {peak / 1e9:.1f} GFLOP/s; MFU {mfu:.1%} (target ≥ 50%)")
    print(f"peak memory: recompute none {memory['none']:.0f} MiB, full {memory['full']:.0f} MiB")
    print(
        f"fathom_tokens_per_cpu_s={fathom_tps:.0f} plain_tokens_per_cpu_s={plain_tps:.0f} "
        f"fathom_tokens_per_s_wall={fathom_wall_tps:.0f} ratio={fathom_tps / plain_tps:.3f} "
        f"peak_gflops={peak / 1e9:.1f} mfu={mfu:.3f} mem_none_mb={memory['none']:.0f} mem_full_mb={memory['full']:.0f}"
    )


if __name__ == "__main__":
    main()
