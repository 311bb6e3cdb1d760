"""Measures this machine as a planner `Device`: `python -m training.planner.calibrate [--ranks 2] [--out cpu.json]`.

- Peak FLOP/s: the best n×n matmul of one thread, fp32 and bf16 (`measure_matmul_peak`, the same
  figure the trainer divides by for its CPU MFU).
- Links: the bus bandwidth of a gloo all-reduce of 16 MiB between `ranks` local processes, and the
  time of a 4-byte all-reduce as the per-collective latency. One host, so "inter-node" is set to the
  same link: pass a JSON edited for a real multi-host CPU cluster.
- Memory: this host's RAM shared by the ranks.

The JSON is `python -m training.planner --device-file`'s input. The `cpu` preset in
training/planner/hardware.py holds what this printed on Fathom's 2-core development machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from training.metrics import measure_matmul_peak
from training.planner.hardware import DEVICES, Device

PAYLOAD_BYTES = 16 * 2**20  # large enough that bandwidth, not latency, sets the time
REPEATS = 5


def matmul_peak(dtype: torch.dtype, n: int = 1024, seconds: float = 0.5) -> float:
    if dtype == torch.float32:
        return measure_matmul_peak(n=n, seconds=seconds)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2.0 * n**3 / (time.perf_counter() - start))
    return best


def _rank(rank: int, world: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    # This measures a CPU host's links: gloo over CPU tensors, whatever GPUs the host may have.
    big, small = torch.ones(PAYLOAD_BYTES // 4, device="cpu"), torch.ones(1, device="cpu")
    dist.all_reduce(big)  # connect and warm up
    times, lat = [], []
    for _ in range(REPEATS):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(big)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        dist.all_reduce(small)
        lat.append(time.perf_counter() - start)
    if rank == 0:
        # Ring bus bandwidth: each rank sends 2·(n-1)/n of the payload.
        busbw = 2 * (world - 1) / world * PAYLOAD_BYTES / min(times)
        Path(out).write_text(json.dumps({"busbw": busbw, "latency": min(lat)}))
    dist.barrier()
    dist.destroy_process_group()


def measure_links(ranks: int) -> tuple[float, float]:
    """(bytes/s, seconds) of a gloo all-reduce among `ranks` local processes."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(ranks, init, out), nprocs=ranks, join=True)
        found = json.loads(Path(out).read_text())
    return found["busbw"], found["latency"]


def measure(ranks: int) -> Device:
    torch.set_num_threads(1)
    fp32, bf16 = matmul_peak(torch.float32), matmul_peak(torch.bfloat16)
    bandwidth, latency = measure_links(ranks)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return dataclasses.replace(
        DEVICES["cpu"],
        name=f"CPU core, gloo ({os.cpu_count()} cores here)",
        memory_gib=round(ram / ranks / 2**30, 1),
        peak_tflops_fp32=round(fp32 / 1e12, 4),
        peak_tflops_bf16=round(bf16 / 1e12, 4),
        intra_node_gbps=round(bandwidth / 1e9, 3),
        inter_node_gbps=round(bandwidth / 1e9, 3),
        intra_node_latency_us=round(latency * 1e6, 1),
        inter_node_latency_us=round(latency * 1e6, 1),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.planner.calibrate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="processes sharing the host in the link test")
    parser.add_argument("--out", type=Path, help="write the Device JSON here as well")
    args = parser.parse_args(argv)
    text = json.dumps(dataclasses.asdict(measure(args.ranks)), indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
