"""Where a rank computes: the one place that picks the device and the collective backend.

A rank uses CUDA with NCCL when torch sees a GPU, its own GPU being `LOCAL_RANK` (torchrun's index
of the process on its node); otherwise the CPU with gloo. On a GPU the process group is
`cpu:gloo,cuda:nccl`: NCCL carries the CUDA tensors, gloo the CPU ones (training.collectives).
Everything device-specific the trainer needs goes through `ComputeDevice`: the mesh's device
type, where tensors go, autocast's device, the MFU denominator (`peak_flops`) and the memory figure.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from training.metrics import measure_matmul_peak, peak_memory_mb

# Dense bf16 tensor-core peak per GPU (vendor data sheets, without sparsity). The first name that
# occurs in `torch.cuda.get_device_name()` wins, so a longer name goes before its prefix.
BF16_PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100", 989.4e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
    ("L4", 121.0e12),
)


@dataclass(frozen=True, kw_only=True)
class ComputeDevice:
    type: Literal["cpu", "cuda"]
    # The default process group's backend: "gloo", or one backend per device type.
    backend: Literal["gloo", "cpu:gloo,cuda:nccl"]
    index: int | None = None  # the GPU of this rank on its node; None on CPU

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.type) if self.index is None else torch.device(self.type, self.index)


CPU = ComputeDevice(type="cpu", backend="gloo")


def choose_device(local_rank: int, cuda_available: bool) -> ComputeDevice:
    """CUDA on GPU `local_rank` (NCCL for its tensors, gloo for CPU ones) when there is a GPU, else CPU + gloo."""
    if cuda_available:
        return ComputeDevice(type="cuda", backend="cpu:gloo,cuda:nccl", index=local_rank)
    return CPU


def device_from_environment() -> ComputeDevice:
    return choose_device(int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.is_available())


def activate(device: ComputeDevice) -> None:
    """Binds this process to its GPU before anything touches CUDA, so NCCL, the caching allocator
    and `torch.cuda`'s current-device calls all use this rank's GPU, not GPU 0 on every rank."""
    if device.type == "cuda":
        torch.cuda.set_device(device.torch_device)


def make_deterministic() -> None:
    """Kernels that give the same bits on every run (`train.deterministic`). cuBLAS reads its
    workspace setting when CUDA first creates a handle, so this runs before the first matmul; an
    operator's own setting stands."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def table_peak_flops(device_name: str) -> float | None:
    """The data-sheet bf16 peak of a GPU named `device_name`, or None if it is not in the table."""
    for name, flops in BF16_PEAK_FLOPS:
        if name in device_name:
            return flops
    return None


def peak_flops(
    device: ComputeDevice, precision: str, cache_dir: Path | None = None, host_cache_dir: Path | None = None
) -> float:
    """The per-rank FLOP/s that MFU divides by, in the run's precision.

    CPU: the best measured matmul in the run's dtype on this process's threads
    (metrics.measure_matmul_peak), so a bf16 run is not divided by the fp32 peak, nor a
    two-thread rank by a one-thread peak. CUDA in bf16: the data sheet's peak for a known GPU;
    otherwise (fp32, or a GPU not in the table) a matmul probe on the GPU in the run's precision.

    A probe takes about half a second, and a restarted job waits for it: with `cache_dir` (the run's),
    the figure measured on this host is kept there and read back by later attempts, which also keeps
    MFU comparable across restarts. A half-second probe on a busy host reads low (others take the
    cores), which would flatter MFU; with `host_cache_dir` (`host_cache()`) the best figure any run
    measured on this host is kept, and a run takes the better of its own probe and that one.
    """
    if device.type == "cpu":
        name = f"cpu-{torch.get_num_threads()}threads"
    else:
        name = torch.cuda.get_device_name(device.torch_device).replace(" ", "_")
    file_name = f"{socket.gethostname()}-{name}-{precision}.json"
    if cache_dir is not None and (cached := _read_flops(cache_dir / file_name)) is not None:
        return cached
    flops = _peak_flops(device, precision)
    if host_cache_dir is not None:
        flops = max(flops, _read_flops(host_cache_dir / file_name) or 0.0)
        _write_flops(host_cache_dir / file_name, flops)
    if cache_dir is not None:
        _write_flops(cache_dir / file_name, flops)
    return flops


def host_cache() -> Path:
    """This host's cache of measured peaks, shared by every run its user starts here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fathom" / "peak_flops"


def _read_flops(path: Path) -> float | None:
    try:
        return float(json.loads(path.read_text())["flops"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_flops(path: Path, flops: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"flops": flops}))
    os.replace(tmp, path)


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype the matmuls of a run in `precision` ("fp32" or "bf16") compute in."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _peak_flops(device: ComputeDevice, precision: str) -> float:
    dtype = precision_dtype(precision)
    if device.type == "cpu":
        # A CPU without bf16 instructions runs bf16 matmuls ~100x slower than fp32 (≈1 GFLOP/s per
        # core on AVX2), so a 1024² sample would take seconds; 512² reaches the same rate.
        return measure_matmul_peak(n=512 if dtype == torch.bfloat16 else 1024, dtype=dtype)
    if precision == "bf16":
        listed = table_peak_flops(torch.cuda.get_device_name(device.torch_device))
        if listed is not None:
            return listed
    return measure_matmul_peak(n=4096, device=device.torch_device, dtype=dtype)


def device_peak_memory_mb(device: ComputeDevice) -> float:
    """Peak memory of this rank where its tensors live: process memory on CPU, allocated GPU memory on CUDA."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device.torch_device) / (1024 * 1024)
    return peak_memory_mb()
