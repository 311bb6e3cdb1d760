"""The rank's process group, and the small agreements its ranks make over it.

The default group carries tensors of both kinds a rank holds: on a GPU host it is initialised as
`cpu:gloo,cuda:nccl`, so the step's CUDA tensors go over NCCL and a CPU tensor (DCP's metadata,
an object list) over gloo instead of failing with "No backend type associated with device type
cpu"; on a CPU host it is plain gloo. Background checkpoint saves get a gloo group of their own
(`training.checkpoint`): their collectives run on another thread, and two threads must never
share a group.

A small agreement (the newest step every rank can restore, Young's interval, a stop request)
goes through `agreed`: its tensor is made here, on the rank's compute device, so it rides the
same backend as the step's collectives. tests/training/test_collective_devices.py reads
training/ and fails on a collective anywhere else whose tensor was made without a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from training.device import ComputeDevice, activate


def init_default_group(device: ComputeDevice, timeout: timedelta) -> None:
    """Joins the world torchrun describes in the environment, bound to this rank's GPU first."""
    activate(device)
    # No `device_id`: with it, DeviceMesh builds its dimensions' groups by splitting this one,
    # which for a gloo + NCCL group torch 2.11 (GPU hosts' image) does with NCCL's options handed
    # to gloo; without it, by new_group, which every backend supports. NCCL then connects at the
    # first collective, on the GPU `activate` bound.
    dist.init_process_group(device.backend, timeout=timeout)


def agreed(values: Sequence[float], op: dist.ReduceOp.RedOpType, *, device: torch.device) -> list[float]:
    """`values` reduced element by element with `op` over every rank of the default group, by one
    all-reduce on `device`. float64 holds every step number and count exactly (below 2⁵³)."""
    figures = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=op)
    return [float(v) for v in figures.tolist()]
