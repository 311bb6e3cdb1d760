"""What a run needs of the cluster and whether the registered hosts could ever hold it.

Only the models are imported here, so `runs.services` can refuse a run that can never fit at
submit, and give back an ended run's devices, without importing the scheduler (which records run
events through `runs.services`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from hosts.models import DeviceClaim, Host
from runs.models import Run

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


# How a host worker names a run's node agent in what it reports it runs (`launch.run_agents.agent_key`).
AGENT_KEY = re.compile(r"^run-(\d+)-node-\d+$")


def agents_on(host: Host) -> set[int]:
    """The runs whose node agent the host's last beat says it runs."""
    return {int(m.group(1)) for p in host.running if (m := AGENT_KEY.match(str(p.get("key", ""))))}


def release(run_ids: list[int] | None = None) -> int:
    """Gives back the devices of ended runs (these, or all) that nothing of them can hold any
    more: on a host that is lost, or whose last beat lists no agent of the run. A run's end is
    reported by its agents while they still run (their ranks exit, their last events and logs
    go out), so its devices stay claimed until their host's next beat says they are gone: no new
    work is placed where an old agent or rank may still run. A queued run holds no devices: those
    still claimed for one are what it held before it went back to the queue (a preemption, a
    lost host), given back the same way. Returns how many were given back."""
    ended = DeviceClaim.objects.filter(run__status__in=[*Run.FINISHED, Run.Status.QUEUED])
    if run_ids is not None:
        ended = ended.filter(run_id__in=run_ids)
    claims = list(ended.select_related("host").only("pk", "run_id", "host__status", "host__running"))
    gone = [c.pk for c in claims if c.host.status == Host.Status.LOST or c.run_id not in agents_on(c.host)]
    deleted, _ = DeviceClaim.objects.filter(pk__in=gone).delete()
    return deleted
