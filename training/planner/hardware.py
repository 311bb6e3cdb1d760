"""The hardware a layout is costed on: one accelerator's memory, compute and links (`Device`,
the presets in `DEVICES`), and how many of them a cluster has per node (`Cluster`). Plain
numbers, no torch."""

from __future__ import annotations

from dataclasses import dataclass

from training.config import (
    Precision,
    SpecError,
)

GiB = float(2**30)

@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator and its links. Bandwidths are what a ring collective sustains per device in
    one direction (NCCL's "bus bandwidth"), not the marketing bidirectional figure."""

    name: str
    memory_gib: float
    peak_tflops_bf16: float  # dense tensor-core peak
    peak_tflops_fp32: float  # what a plain fp32 matmul gets (no TF32)
    intra_node_gbps: float  # GB/s per device inside a node (NVLink / shared memory)
    inter_node_gbps: float  # GB/s per device between nodes (its NIC share)
    intra_node_latency_us: float = 10.0  # per collective or send; matters for small messages only
    inter_node_latency_us: float = 30.0
    reserved_gib: float = 3.0  # CUDA context, communicator buffers, allocator fragmentation
    # Fraction of peak that large transformer matmuls sustain. An assumption, not a measurement:
    # Hopper GEMMs of these shapes run at 65-75 % of the dense peak; attention and elementwise kernels less.
    matmul_efficiency: float = 0.6

    def peak_flops(self, precision: Precision) -> float:
        return 1e12 * (self.peak_tflops_bf16 if precision == "bf16" else self.peak_tflops_fp32)


DEVICES: dict[str, Device] = {
    # H100 SXM: 989 dense BF16 TFLOP/s, 67 FP32; NVLink 4 at 450 GB/s per direction, of which NCCL
    # rings reach ~360; one 400 Gb/s NIC per GPU (50 GB/s) reaching ~40.
    "h100": Device(
        name="H100 SXM 80 GB",
        memory_gib=80,
        peak_tflops_bf16=989,
        peak_tflops_fp32=67,
        intra_node_gbps=360,
        inter_node_gbps=40,
    ),
    # H200: the H100's compute and links with 141 GB of HBM3e (nvidia-smi reports ~140 GiB).
    "h200": Device(
        name="H200 SXM 141 GB",
        memory_gib=140,
        peak_tflops_bf16=989,
        peak_tflops_fp32=67,
        intra_node_gbps=360,
        inter_node_gbps=40,
    ),
    # A100 SXM 80 GB: 312 BF16, 19.5 FP32; NVLink 3 at 300 GB/s per direction (~230 in rings);
    # a 200 Gb/s HDR NIC per GPU (25 GB/s, ~22 sustained). Ampere GEMMs reach a larger share of peak.
    "a100": Device(
        name="A100 SXM 80 GB",
        memory_gib=80,
        peak_tflops_bf16=312,
        peak_tflops_fp32=19.5,
        intra_node_gbps=230,
        inter_node_gbps=22,
        matmul_efficiency=0.7,
    ),
    # One CPU rank per core with gloo over loopback, as `python -m training.planner.calibrate --ranks 2`
    # measured on Fathom's 2-core development machine (shared, so the link figures are noisy);
    # rerun it elsewhere and pass the JSON with --device-file. Tiny models on CPU are dominated by
    # per-op overhead, so step times here are optimistic; memory and traffic are what is calibrated.
    "cpu": Device(
        name="CPU core (gloo)",
        memory_gib=11.8,
        peak_tflops_bf16=0.12,
        peak_tflops_fp32=0.045,
        intra_node_gbps=0.98,
        inter_node_gbps=0.98,
        intra_node_latency_us=270,
        inter_node_latency_us=270,
        reserved_gib=0.3,
        matmul_efficiency=0.5,
    ),
}


@dataclass(frozen=True, kw_only=True)
class Cluster:
    device: Device
    nodes: int
    devices_per_node: int

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(name, f"must be a positive integer; got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, span: int) -> tuple[float, float]:
        """(bytes/s, seconds of latency) of a group whose ranks lie within `span` consecutive ranks."""
        d = self.device
        if span <= self.devices_per_node:
            return d.intra_node_gbps * 1e9, d.intra_node_latency_us * 1e-6
        return d.inter_node_gbps * 1e9, d.inter_node_latency_us * 1e-6


