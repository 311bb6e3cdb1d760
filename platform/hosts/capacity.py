"""What a run needs of the cluster and whether the registered hosts could ever hold it.

Only `hosts.models` is imported here, so `runs.services` can refuse a run that can never fit at
submit without importing the scheduler (which records run events through `runs.services`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hosts.models import DeviceClaim, Host

KINDS = ("gpu", "cpu")


@dataclass(frozen=True)
class Need:
    """A run's gang: `nodes` hosts, each giving `per_node` devices of one kind."""

    nodes: int
    per_node: int

    @property
    def total(self) -> int:
        return self.nodes * self.per_node


def need_of(spec: dict[str, Any]) -> Need:
    """From a stored (resolved) spec: nodes.max nodes of nproc_per_node ranks, one device each."""
    layout = spec.get("layout", {})
    world = int(layout.get("dp", 1)) * int(layout.get("tp", 1)) * int(layout.get("pp", 1))
    nodes = int(spec.get("nodes", {}).get("max", 1))
    per_node = int(spec.get("nodes", {}).get("nproc_per_node", 0)) or max(world // nodes, 1)
    return Need(nodes=nodes, per_node=per_node)


def devices_word(kind: str, count: int) -> str:
    if kind == "gpu":
        return f"{count} GPU" + ("" if count == 1 else "s")
    return f"{count} CPU slot" + ("" if count == 1 else "s")


def why_it_never_fits(need: Need, hosts: list[Host]) -> str:
    """Empty when the hosts of some kind, all of them free, could hold the run; else why not.

    Every registered host counts, lost and draining ones too: they may come back, and a run that
    would fit then is not refused now. A host holds as many of the run's nodes as it has
    `per_node` devices (nodes spread over hosts when they can, but may share one)."""
    if not hosts:
        return ""
    reasons = []
    for kind in KINDS:
        sizes = sorted((len(h.device_indexes) for h in hosts if h.device_kind == kind), reverse=True)
        if not sizes:
            continue
        if sum(size // need.per_node for size in sizes) >= need.nodes:
            return ""
        hosts_word = f"{len(sizes)} {kind.upper()} host{'s' if len(sizes) != 1 else ''}"
        reasons.append(f"{hosts_word} with {devices_word(kind, sum(sizes))} in all, at most {sizes[0]} on one host")
    kind = next(k for k in KINDS if any(h.device_kind == k for h in hosts))
    return (
        f"needs {need.nodes} node{'s' if need.nodes != 1 else ''} × {devices_word(kind, need.per_node)} "
        f"({need.total} in all, each node on one host); the cluster has {', '.join(reasons)}"
    )


def cluster_exists() -> bool:
    """Whether any host ever registered: then runs are placed on hosts, else started locally."""
    return Host.objects.exists()


def release(run_id: int) -> int:
    """Gives back a run's devices when it ends; returns how many (0: it held none)."""
    deleted, _ = DeviceClaim.objects.filter(run_id=run_id).delete()
    return deleted
