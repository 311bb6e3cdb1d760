"""What a host offers: its GPUs (from nvidia-smi), or CPU slots on a host without one."""

from __future__ import annotations

import shutil
import subprocess
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


def cpu_slots(count: int) -> list[dict[str, Any]]:
    return [{"index": i, "kind": "cpu", "model": "cpu", "memory_mb": 0} for i in range(count)]


def detect(cpu_slot_count: int) -> list[dict[str, Any]]:
    return gpus() or cpu_slots(cpu_slot_count)
