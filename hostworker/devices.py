"""What a host offers: its GPUs (from nvidia-smi), or CPU slots on a host without one."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any


def gpus() -> list[dict[str, Any]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20, check=True,
        ).stdout  # fmt: skip
    except (subprocess.SubprocessError, OSError):
        return []
    found = []
    for line in out.splitlines():
        index, name, memory = (part.strip() for part in line.split(","))
        found.append({"index": int(index), "kind": "gpu", "model": name, "memory_mb": int(float(memory))})
    return found


def memory_mb() -> int:
    """The machine's RAM (/proc/meminfo's MemTotal); 0 where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def cpu_slots(count: int) -> list[dict[str, Any]]:
    """`count` CPU slots, each with an equal share of the machine's RAM: what placement checks a
    rank's memory against."""
    share = memory_mb() // max(count, 1)
    return [{"index": i, "kind": "cpu", "model": "cpu", "memory_mb": share} for i in range(count)]


def cpu_flags() -> list[str]:
    """The CPU's feature flags (/proc/cpuinfo; none where it has no such file): the control plane
    places a replica only on a host whose CPU has the kernels its options need (int4: AVX-512)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(line.split(":", 1)[1].split())
    except OSError:
        pass
    return []


def usable_cores() -> list[int]:
    """The cores this host worker may use (its affinity: a container's cpuset, a taskset)."""
    return sorted(os.sched_getaffinity(0))


def slot_cores(slots: list[int], slot_count: int, cores: list[int]) -> list[list[int]]:
    """The cores each of `slots` (CPU slot indexes of a host that offers `slot_count`) runs on:
    an equal share of the host's `cores` per slot, so that what runs on one slot never takes
    another's cores; slots cycle over the cores when there are more slots than cores."""
    share = max(1, len(cores) // max(slot_count, 1))
    return [[cores[(slot * share + i) % len(cores)] for i in range(share)] for slot in slots]


def detect(cpu_slot_count: int) -> list[dict[str, Any]]:
    return gpus() or cpu_slots(cpu_slot_count)
