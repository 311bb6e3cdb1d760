"""What rank 0 reports: the events file the node agent tails, model FLOPs utilisation, memory.

Event contract (one JSON object per line, appended and flushed line by line):

    {"kind": "metrics", "time": t, "step": n, "loss": f, "lr": f, "grad_norm": f,
     "tokens_per_s": f, "mfu": f, "step_time": f, "memory_mb": f}
    {"kind": "checkpoint", "time": t, "step": n, "path": "<committed checkpoint dir>"}
    {"kind": "resumed", "time": t, "step": n}        # started from the checkpoint of step n
    {"kind": "finished", "time": t, "step": n}

`memory_mb` is rank 0's peak: process memory on CPU, allocated GPU memory on CUDA (training/device.py).

Rank 0 also prints one line per step (`step_line`), on resume and on each committed checkpoint to
stdout, flushed: the node agent captures it as the run's log, which users follow live.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

METRIC_KEYS = ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "step_time", "memory_mb")


class EventLog:
    """Appends events to a JSON-lines file; each line is flushed so a tailing reader sees it at once."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: TextIO = path.open("a", encoding="utf-8")

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"kind": kind, "time": time.time(), **fields}
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        return event

    def close(self) -> None:
        self._file.close()


def step_line(metrics: dict[str, Any], total_steps: int) -> str:
    """Rank 0's human-readable line for one step, as users read it in the run's log.

    e.g. `step 12/200 loss 3.4512 lr 2.9e-03 grad_norm 0.812 tok/s 5120 mfu 41.2% step 0.21s mem 812MB`
    """
    return (
        f"step {metrics['step']}/{total_steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.1e} "
        f"grad_norm {metrics['grad_norm']:.3f} tok/s {metrics['tokens_per_s']:.0f} "
        f"mfu {100 * metrics['mfu']:.1f}% step {metrics['step_time']:.2f}s mem {metrics['memory_mb']:.0f}MB"
    )


def read_events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def measure_matmul_peak(
    n: int = 1024,
    seconds: float = 0.5,
    clock: Callable[[], float] = time.perf_counter,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> float:
    """Best FLOP/s of an n×n matmul (fp32 unless `dtype`) on this process's threads or `device`:
    the denominator of MFU where no data-sheet peak applies.

    A vendor's peak assumes every core at full vector throughput; the measured best of a large
    matmul is what the model's own matmuls could at most reach here, so MFU reads as a fraction of
    the achievable. The best, not the mean, of repeated runs discounts interference from others;
    `clock=time.thread_time` counts only the time this thread ran (a busy shared host). On a GPU
    each matmul is waited for, since kernels launch asynchronously.
    """
    device = device or torch.device("cpu")

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, caches
    wait()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = clock()
        torch.mm(a, b)
        wait()
        elapsed = clock() - start
        best = max(best, 2.0 * n**3 / elapsed)
        if time.perf_counter() > deadline:
            return best


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of the ranks doing the work."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops > 0 else 0.0


def peak_memory_mb() -> float:
    """This process's peak resident memory; on CPU the sum of weights, optimizer, activations and runtime.

    Linux: VmHWM, the high-water mark of this program's own address space. `ru_maxrss` is not used
    there because exec carries the parent's mark over (a rank started by a big process would report
    the parent's peak).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # KiB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB elsewhere
