"""Gang placement: a queued run gets all its nodes' devices at once, or waits with a reason.

One pass (`schedule`) runs in one transaction. It locks every host row first (`select_for_update`
on PostgreSQL; on SQLite the transaction is IMMEDIATE, so it holds the database's write lock from
its start), so two schedulers take turns. Runs are offered the free devices in queue order,
higher `priority` first, then the older run; the first run that does not fit stops the pass (the
runs behind it wait for it, so a large run is not starved by small ones). A placement is
`DeviceClaim` rows, unique per (host, device): whatever happens, no device is given twice. The
claim and the run's move to `starting` commit together; the caller then sends the start tasks.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from hosts.capacity import KINDS, Need, devices_word, need_of
from hosts.models import DeviceClaim, Host
from runs import launcher, services
from runs.models import Run


@dataclass(frozen=True)
class NodePlacement:
    node: int
    host: Host
    devices: list[int]


def placement_of(run: Run) -> list[NodePlacement]:
    """The run's placed nodes in node order; empty if it holds no devices."""
    by_node: dict[int, list[DeviceClaim]] = defaultdict(list)
    for claim in DeviceClaim.objects.filter(run=run).select_related("host"):
        by_node[claim.node].append(claim)
    return [
        NodePlacement(node, claims[0].host, sorted(c.device for c in claims))
        for node, claims in sorted(by_node.items())
    ]


def place(need: Need, hosts: list[Host], free: dict[int, list[int]]) -> list[tuple[Host, list[int]]] | None:
    """A host and `need.per_node` free devices for each of the run's nodes, all of one kind, or None.

    Nodes go to distinct hosts while there are hosts to spread over (a lost host then costs the
    run one node), and only then share one. Among those that hold a node, the host with the
    fewest free devices is taken (best fit), so large holes stay for large runs. GPU hosts are
    tried before CPU hosts."""
    for kind in KINDS:
        left = {h.pk: list(free[h.pk]) for h in hosts if h.device_kind == kind}
        gang: list[tuple[Host, list[int]]] = []
        for _ in range(need.nodes):
            used = {host.pk for host, _ in gang}
            fitting = [h for h in hosts if h.pk in left and len(left[h.pk]) >= need.per_node]
            if not fitting:
                break
            host = min(fitting, key=lambda h: (h.pk in used, len(left[h.pk]), h.name))
            gang.append((host, left[host.pk][: need.per_node]))
            left[host.pk] = left[host.pk][need.per_node :]
        if len(gang) == need.nodes:
            return gang
    return None


def waiting_reason(need: Need, hosts: list[Host], free: dict[int, list[int]]) -> str:
    best = ""
    for kind in KINDS:
        of_kind = [h for h in hosts if h.device_kind == kind]
        if not of_kind:
            continue
        total_free = sum(len(free[h.pk]) for h in of_kind)
        reason = f"waiting: needs {devices_word(kind, need.total)}"
        if need.nodes > 1:
            reason += f" ({need.nodes} nodes × {need.per_node}, each node on one host)"
        reason += f", {total_free} free"
        if total_free >= need.total:
            room = sum(len(free[h.pk]) // need.per_node for h in of_kind)
            reason += f" but room for {room} node{'s' if room != 1 else ''} of {need.per_node} on one host"
        best = best or reason
    return best or "waiting: no ready host"


def _rendezvous_endpoint(address: str) -> str:
    """A port on `address` that no active run's rendezvous holds."""
    taken = {
        endpoint.rpartition(":")[2]
        for endpoint in Run.objects.filter(status__in=Run.ACTIVE, rendezvous__startswith=f"{address}:").values_list(
            "rendezvous", flat=True
        )
    }
    ports = [p for p in settings.RENDEZVOUS_PORTS if str(p) not in taken]
    return f"{address}:{random.choice(ports)}"


def schedule() -> list[int]:
    """One placement pass; returns the runs placed (moved to `starting`), whose start tasks the
    caller sends."""
    placed: list[int] = []
    with transaction.atomic():
        hosts = list(Host.objects.select_for_update().order_by("pk"))
        if not hosts:
            return placed
        # Devices of runs that ended go back (normally done when they end; this catches the rest).
        DeviceClaim.objects.filter(run__status__in=Run.FINISHED).delete()
        claimed: dict[int, set[int]] = defaultdict(set)
        for host_id, device in DeviceClaim.objects.values_list("host_id", "device"):
            claimed[host_id].add(device)
        ready = [h for h in hosts if h.status == Host.Status.READY]
        free = {h.pk: [d for d in h.device_indexes if d not in claimed[h.pk]] for h in hosts}
        blocker: Run | None = None
        queue = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False).order_by(
            "-priority", "created_at", "pk"
        )
        for run in queue:
            need = need_of(run.spec)
            if blocker is None and run.resume and launcher.agents_alive(run):
                # Its previous agents are still stopping: their last events must land first.
                reason = "waiting: its previous agents are still stopping"
                blocker = run
            elif blocker is None:
                gang = place(need, ready, free)
                if gang is not None:
                    if _claim(run, gang):
                        for host, devices in gang:
                            free[host.pk] = [d for d in free[host.pk] if d not in devices]
                        placed.append(run.pk)
                    continue
                reason = waiting_reason(need, ready, free)
                blocker = run
            else:
                reason = f"waiting: behind run {blocker.pk} ({blocker.name}) in the queue"
            if run.status_reason != reason:
                Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED).update(status_reason=reason)
                services.do_record_event(run, "waiting", {"reason": reason})
    return placed


def _claim(run: Run, gang: list[tuple[Host, list[int]]]) -> bool:
    """Gives the run its devices and moves it to `starting`, together; False if it moved on."""
    if not Run.objects.filter(pk=run.pk, status=Run.Status.QUEUED, cancel_requested=False).update(
        status=Run.Status.STARTING,
        status_reason="",
        launch_attempts=F("launch_attempts") + 1,
        last_report_at=timezone.now(),
        rendezvous=_rendezvous_endpoint(gang[0][0].address),
    ):
        return False
    DeviceClaim.objects.bulk_create(
        DeviceClaim(host=host, device=device, run=run, node=node)
        for node, (host, devices) in enumerate(gang)
        for device in devices
    )
    nodes = [
        {"node": node, "host": host.name, "address": host.address, "devices": devices}
        for node, (host, devices) in enumerate(gang)
    ]
    services.do_record_event(run, "placed", {"nodes": nodes})
    services.do_record_event(run, "status", {"status": Run.Status.STARTING, "reason": ""})
    return True
