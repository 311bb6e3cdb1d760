"""What rank 0 measures: model FLOPs utilisation, memory, and the step line of the run's log.

`tokens_per_s` is the step's tokens over the wall time since the previous step ended (the step's
own time for the first step of an attempt), so whatever runs between steps (a checkpoint save, hooks)
lowers it as it lowers what a user gets; `step_time` is the step alone. `mfu` is `mfu(tokens_per_s,
…)`: the same function as bench.train_throughput's and the planner's FLOP count. `memory_mb` is rank
0's peak: process memory on CPU, allocated GPU memory on CUDA (training/device.py). The events
that carry them are `training.rank_events`'.

Rank 0 also prints one line per step (`step_line`), on resume and on each committed checkpoint to
stdout, flushed: the node agent captures it as the run's log, which users follow live.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import TYPE_CHECKING, Any

from training.config import ModelConfig

if TYPE_CHECKING:  # torch is imported where a probe runs: the planner and control plane use this module without it
    import torch

def step_line(metrics: dict[str, Any], total_steps: int) -> str:
    """Rank 0's human-readable line for one step, as users read it in the run's log.

    e.g. `step 12/200 loss 3.4512 lr 2.9e-03 grad_norm 0.812 tok/s 5120 mfu 41.2% step 0.21s mem 812MB`
    """
    return (
        f"step {metrics['step']}/{total_steps} loss {metrics['loss']:.4f} lr {metrics['lr']:.1e} "
        f"grad_norm {metrics['grad_norm']:.3f} tok/s {metrics['tokens_per_s']:.0f} "
        f"mfu {100 * metrics['mfu']:.1f}% step {metrics['step_time']:.2f}s mem {metrics['memory_mb']:.0f}MB"
    )


def flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (forward + backward, 3× the forward) that MFU counts.

    Weights: 6 per weight in a matmul, i.e. every weight but the embedding (a lookup; tied to the
    head, its matrix is the head's matmul), the norm gains and the biases. Attention's score and value matmuls: per layer and token, QKᵀ and PV cost 2·seq·dim
    each in the forward without a mask, so 12·dim·seq for forward + backward (PaLM, appendix B);
    the model's mask is causal, so a query meets on average half the keys and Fathom counts half
    of that: 6·layers·dim·seq (as FlashAttention's own causal FLOP count does).
    """
    # A tied head is the embedding's matrix, counted once by num_params, and still a matmul.
    lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    gains = (2 * cfg.n_layers + 1) * cfg.dim + (2 * cfg.n_layers * cfg.head_dim if cfg.qk_norm else 0)
    biases = cfg.n_layers * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim if cfg.qkv_bias else 0
    matmul_weights = cfg.num_params() - lookup - gains - biases
    attention_width = cfg.n_heads * cfg.head_dim  # dim, unless heads have a size of their own (Qwen3)
    return 6.0 * matmul_weights + 6.0 * cfg.n_layers * attention_width * cfg.seq_len


def mfu(tokens_per_s: float, model: ModelConfig, peak_flops: float) -> float:
    """Model FLOPs utilisation: `model`'s FLOP/s at `tokens_per_s` (flops_per_token) over
    `peak_flops`, the peak of all the ranks doing the work in the run's precision (training/device.py:
    measured on CPU, the data sheet's on a known GPU). The dashboard, the rank's log line and
    bench.train_throughput all compute it here."""
    return tokens_per_s * flops_per_token(model) / peak_flops if peak_flops > 0 else 0.0


def measure_matmul_peak(
    n: int = 1024,
    seconds: float = 0.5,
    device: torch.device | None = None,
    dtype: torch.dtype | None = None,
) -> float:
    """Best wall-clock FLOP/s of an n×n matmul in `dtype` (fp32 by default) on this process's
    current threads (`torch.get_num_threads()`) or on `device`: the denominator of MFU where no
    data-sheet peak applies.

    A vendor's peak assumes every core at full vector throughput; the measured best of a large
    matmul is what the model's own matmuls could at most reach here, so MFU reads as a fraction of
    the achievable. The best, not the mean, of repeated runs discounts interference from others,
    which would otherwise lower the peak and flatter MFU. Timed with `time.perf_counter` like the
    steps it is compared with. On a GPU each matmul is waited for, since kernels launch
    asynchronously.
    """
    import torch

    device = device or torch.device("cpu")
    dtype = dtype or torch.float32

    def wait() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool, caches
    wait()
    best = 0.0
    deadline = time.perf_counter() + seconds
    while True:
        start = time.perf_counter()
        torch.mm(a, b)
        wait()
        elapsed = time.perf_counter() - start
        best = max(best, 2.0 * n**3 / elapsed)
        if time.perf_counter() > deadline:
            return best


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
