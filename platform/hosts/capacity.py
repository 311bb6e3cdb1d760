"""What a run needs of the cluster and whether the registered hosts could ever hold it.

Only the models are imported here, so `runs.services` can refuse a run that can never fit at
submit, and give back an ended run's devices, without importing the scheduler (which records run
events through `runs.services`).
"""

from __future__ import annotations

import functools
import json
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


@functools.lru_cache(maxsize=4096)
def parsed_json(text: str | None) -> Any:
    """A JSON text's value ({} for none), decoded once per distinct text: a pass reads a field of
    thousands of runs, of which few differ. Shared by every caller that reads the same text, so
    never changed by one."""
    return json.loads(text) if text else {}


@functools.lru_cache(maxsize=4096)
def need_of_json(layout: str | None, nodes: str | None) -> Need:
    """`need_of` a spec whose `layout` and `nodes` are given as their JSON texts."""
    return need_of({"layout": parsed_json(layout), "nodes": parsed_json(nodes)})


def wanted_kinds(spec: dict[str, Any], cluster_has_gpus: bool) -> tuple[str, ...]:
    """The device kinds a run may be placed on, in the order they are tried (`resources.device`;
    empty: GPUs where the cluster has a GPU host, else CPU slots)."""
    device = (spec.get("resources") or {}).get("device") or ("gpu" if cluster_has_gpus else "cpu")
    return KINDS if device == "any" else (device,)


def devices_word(kind: str, count: int) -> str:
    if kind == "gpu":
        return f"{count} GPU" + ("" if count == 1 else "s")
    return f"{count} CPU slot" + ("" if count == 1 else "s")


def why_it_never_fits(need: Need, hosts: list[Host], kinds: tuple[str, ...] = KINDS) -> str:
    """Empty when the hosts of some kind, all of them free, could hold the run; else why not.

    Every registered host counts, lost and draining ones too: they may come back, and a run that
    would fit then is not refused now. A host holds as many of the run's nodes as it has
    `per_node` devices (nodes spread over hosts when they can, but may share one)."""
    if not hosts:
        return ""
    if not any(h.device_kind in kinds for h in hosts):
        return f"asks for {' or '.join(k.upper() for k in kinds)} devices (resources.device); the cluster has none"
    reasons = []
    for kind in kinds:
        sizes = sorted((len(h.device_indexes) for h in hosts if h.device_kind == kind), reverse=True)
        if not sizes:
            continue
        if sum(size // need.per_node for size in sizes) >= need.nodes:
            return ""
        hosts_word = f"{len(sizes)} {kind.upper()} host{'s' if len(sizes) != 1 else ''}"
        reasons.append(f"{hosts_word} with {devices_word(kind, sum(sizes))} in all, at most {sizes[0]} on one host")
    kind = next(k for k in kinds if any(h.device_kind == k for h in hosts))
    return (
        f"needs {need.nodes} node{'s' if need.nodes != 1 else ''} × {devices_word(kind, need.per_node)} "
        f"({need.total} in all, each node on one host); the cluster has {', '.join(reasons)}"
    )


def device_memory_mb(host: Host) -> int:
    """The least memory of the host's devices of its kind, in MB; 0: not reported (no check)."""
    sizes = [int(d.get("memory_mb") or 0) for d in host.devices if d.get("kind") == host.device_kind]
    return min(sizes) if sizes and all(sizes) else 0


def holds_rank(host: Host, rank_memory_mb: dict[str, int]) -> bool:
    """Whether each device of the host holds one rank of a run needing `rank_memory_mb` (by kind)."""
    need, has = int(rank_memory_mb.get(host.device_kind) or 0), device_memory_mb(host)
    return not need or not has or need <= has


def gib(mb: int) -> str:
    return f"{mb / 1024:.1f} GiB"


def why_memory_never_fits(rank_memory_mb: dict[str, int], kinds: tuple[str, ...], hosts: list[Host]) -> str:
    """Empty when some registered host of `kinds` has devices that hold one of the run's ranks
    (or reports no memory); else the numbers: what a rank needs and the most any device has."""
    of_kind = [h for h in hosts if h.device_kind in kinds]
    if not of_kind or not rank_memory_mb or any(holds_rank(h, rank_memory_mb) for h in of_kind):
        return ""
    parts = []
    for kind in kinds:
        largest = max((device_memory_mb(h) for h in of_kind if h.device_kind == kind), default=0)
        if largest:
            device = "GPU" if kind == "gpu" else "CPU slot (its share of the host's RAM)"
            parts.append(f"about {gib(rank_memory_mb[kind])} on a {device}, and the largest has {gib(largest)}")
    return (
        "each rank needs " + "; or ".join(parts) + " (the planner's estimate): shard it over more ranks "
        "(layout.tp, layout.pp, layout.zero), recompute activations (layout.recompute), or lower "
        "train.global_batch per pass (train.grad_accum)"
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
