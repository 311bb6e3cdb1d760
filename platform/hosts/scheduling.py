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
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from hosts.capacity import KINDS, Need, devices_word, need_of, release
from hosts.models import DeviceClaim, Host
from runs.models import Run, RunEvent
from training.ports import listen_port

# How a host worker names a deployment's replica supervisor in what it reports it runs.
SUPERVISOR_KEY = re.compile(r"^deployment-(\d+)$")


def supervisors_on(host: Host) -> set[int]:
    """The deployments whose supervisor the host's last beat says it runs."""
    return {int(m.group(1)) for p in host.running if (m := SUPERVISOR_KEY.match(str(p.get("key", ""))))}


def orphans_on(host: Host, held: set[tuple[int, int]] | None = None) -> list[str]:
    """The supervisors the host runs for deployments that hold no device on it (any more): what
    was left running there while it was lost, or a start that arrived after its deployment
    ended. `held`: the (host, deployment) pairs of every deployment claim, when already read."""
    if held is None:
        held = set(DeviceClaim.objects.filter(host=host, deployment__isnull=False).values_list("host_id", "deployment_id"))
    return [f"deployment-{pk}" for pk in sorted(supervisors_on(host)) if (host.pk, pk) not in held]


def release_ended_claims(hosts: list[Host]) -> None:
    """Gives back the devices of ended runs (`capacity.release`) and of stopped and failed
    deployments once nothing of them can hold them: their host is lost, or its last beat lists
    no agent or supervisor of theirs. Until then a device stays claimed, so no new work is
    placed where an old rank or replica may still run."""
    release()
    by_id = {h.pk: h for h in hosts}
    running = {h.pk: supervisors_on(h) for h in hosts}
    ended = DeviceClaim.objects.filter(deployment__status__in=["stopped", "failed"])
    gone = [
        pk for pk, host_id, deployment_id in ended.values_list("pk", "host_id", "deployment_id")
        if host_id not in by_id or by_id[host_id].status == Host.Status.LOST or deployment_id not in running[host_id]
    ]  # fmt: skip
    DeviceClaim.objects.filter(pk__in=gone).delete()


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


def place(need: Need, hosts: dict[str, list[Host]], free: dict[int, list[int]]) -> list[tuple[Host, list[int]]] | None:
    """A host and `need.per_node` free devices for each of the run's nodes, all of one kind, or None.

    `hosts`: the ready hosts by kind. Nodes go to distinct hosts while there are hosts to spread
    over (a lost host then costs the run one node), and only then share one. Among those that
    hold a node, the host with the fewest free devices is taken (best fit), so large holes stay
    for large runs. GPU hosts are tried before CPU hosts."""
    # (`id`, a plain attribute, not `pk`, a property: this runs for every host for every run.)
    for kind in KINDS:
        left = {h.id: free[h.id] for h in hosts.get(kind, []) if len(free[h.id]) >= need.per_node}
        if sum(len(devices) // need.per_node for devices in left.values()) < need.nodes:
            continue
        by_id = {h.id: h for h in hosts[kind] if h.id in left}
        gang: list[tuple[Host, list[int]]] = []
        used: set[int] = set()
        for _ in range(need.nodes):
            chosen = min(
                (i for i, devices in left.items() if len(devices) >= need.per_node),
                key=lambda i: (i in used, len(left[i]), by_id[i].name),
            )
            gang.append((by_id[chosen], left[chosen][: need.per_node]))
            left[chosen] = left[chosen][need.per_node :]
            used.add(chosen)
        return gang
    return None


def waiting_reason(need: Need, hosts: dict[str, list[Host]], free: dict[int, list[int]]) -> str:
    for kind in KINDS:
        of_kind = hosts.get(kind, [])
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
        return reason
    return "waiting: no ready host"


# The reason of every run behind the first that does not fit: one text, so a queue of thousands
# is one UPDATE when it forms and none while it stays (the run holding it names its own reason).
BEHIND = "waiting: behind an earlier run in the queue that does not fit yet"


class RunsSide(Protocol):
    """What a pass asks of the runs' side (`hosts.tasks.RUNS_SIDE`): placement decides and claims
    devices; a run's status and events are recorded by runs.services, and whether its earlier
    agents still run is the launch's to say."""

    def still_stopping(self, run: Run) -> bool:
        """A queued run's earlier agents still stop: their last events must land first."""
        ...

    def move_to_starting(self, run: Run, rendezvous: str, nodes: list[dict[str, Any]]) -> list[RunEvent] | None:
        """The run's move to `starting`, inside the pass's transaction; its events unsaved, or
        None if it moved on since it was read."""
        ...

    def write_events(self, events: list[RunEvent]) -> None: ...

    def note_waiting(self, run: Run, reason: str) -> bool: ...


class Pass:
    """What one scheduling pass knows: free devices per host, rendezvous ports in use, and the
    claims and events of the runs it placed, written together at its end."""

    def __init__(self, hosts: list[Host]) -> None:
        claimed: dict[int, set[int]] = defaultdict(set)
        for host_id, device in DeviceClaim.objects.values_list("host_id", "device"):
            claimed[host_id].add(device)
        self.free = {h.pk: [d for d in h.device_indexes if d not in claimed[h.pk]] for h in hosts}
        self.ready: dict[str, list[Host]] = defaultdict(list)
        held = set(DeviceClaim.objects.filter(deployment__isnull=False).values_list("host_id", "deployment_id"))
        for host in hosts:
            # A host still running a supervisor no claim covers gets nothing new until it is
            # gone (its heartbeat has it stopped): that supervisor's replicas may hold devices.
            if host.status == Host.Status.READY and not orphans_on(host, held):
                self.ready[host.device_kind].append(host)
        self.ports: dict[str, set[str]] = defaultdict(set)
        for endpoint in (
            Run.objects.filter(status__in=Run.ACTIVE).exclude(rendezvous="").values_list("rendezvous", flat=True)
        ):
            address, _, port = endpoint.rpartition(":")
            self.ports[address].add(port)
        self.claims: list[DeviceClaim] = []
        self.events: list[RunEvent] = []

    def rendezvous_endpoint(self, gang: list[tuple[Host, list[int]]]) -> str:
        """Where the run's agents meet: for one node, a port on its host, where its agent hosts
        the store; for several, a port on the control plane's machine, where the launcher starts
        the store (`run_agents.start_store_here`), so that no host of the run holds it. A port no
        active run's rendezvous holds, and on this machine one nothing listens on now."""
        address = settings.RENDEZVOUS_ADDRESS if len(gang) > 1 else gang[0][0].address
        free = [p for p in settings.RENDEZVOUS_PORTS if str(p) not in self.ports[address]]
        port = str(listen_port(free, host="") if len(gang) > 1 else random.choice(free))
        self.ports[address].add(port)
        return f"{address}:{port}"

    def claim(self, run: Run, gang: list[tuple[Host, list[int]]], runs: RunsSide) -> bool:
        """Gives the run its devices and rendezvous, and has the runs' side move it to `starting`;
        False if it moved on meanwhile."""
        endpoint = self.rendezvous_endpoint(gang)
        nodes = [
            {"node": node, "host": host.name, "address": host.address, "devices": devices}
            for node, (host, devices) in enumerate(gang)
        ]
        events = runs.move_to_starting(run, endpoint, nodes)
        if events is None:
            return False
        for node, (host, devices) in enumerate(gang):
            self.free[host.pk] = [d for d in self.free[host.pk] if d not in devices]
            self.claims += [DeviceClaim(host=host, device=device, run=run, node=node) for device in devices]
        self.events += events
        return True

    def write(self, runs: RunsSide) -> None:
        # The unique (host, device) constraint refuses a device given twice right here.
        DeviceClaim.objects.bulk_create(self.claims, batch_size=1000)
        runs.write_events(self.events)


def schedule(runs: RunsSide) -> list[int]:
    """One placement pass; returns the runs placed (moved to `starting`), whose start tasks the
    caller sends."""
    placed: list[int] = []
    with transaction.atomic():
        hosts = list(Host.objects.select_for_update().order_by("pk"))
        if not hosts:
            return placed
        # Devices of runs and deployments that ended go back once nothing of them runs.
        release_ended_claims(hosts)
        this = Pass(hosts)
        queue = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False).order_by(
            "-priority", "created_at", "pk"
        )
        for run in queue.iterator(chunk_size=200):
            need = need_of(run.spec)
            if run.resume and runs.still_stopping(run):
                reason = "waiting: its previous agents are still stopping"
            else:
                gang = place(need, this.ready, this.free)
                if gang is not None:
                    if this.claim(run, gang, runs):
                        placed.append(run.pk)
                    continue
                reason = waiting_reason(need, this.ready, this.free)
            if run.status_reason != reason:
                runs.note_waiting(run, reason)
            # The runs behind it wait for it (no small run starves a large one).
            queue.filter(
                Q(priority__lt=run.priority)
                | Q(priority=run.priority, created_at__gt=run.created_at)
                | Q(priority=run.priority, created_at=run.created_at, pk__gt=run.pk)
            ).exclude(status_reason=BEHIND).update(status_reason=BEHIND)
            break
        this.write(runs)
    return placed


@dataclass(frozen=True)
class ReplicaGroup:
    """The replicas of a deployment that one host runs, under one supervisor: replica
    `first_replica + i` serves on `devices[i * per_replica : (i + 1) * per_replica]`."""

    host: Host
    devices: list[int]
    first_replica: int
    per_replica: int = 1

    @property
    def replicas(self) -> list[int]:
        return list(range(self.first_replica, self.first_replica + len(self.devices) // self.per_replica))


def place_deployment(
    deployment_id: int,
    replicas: int,
    kind: str,
    per_replica: int = 1,
    refusal: Callable[[Host], str | None] = lambda host: None,
    first_replica: int = 0,
) -> list[ReplicaGroup] | str:
    """`per_replica` free devices of `kind` ("gpu" or "cpu") on one ready host for each replica,
    claimed for the deployment in one transaction (host rows locked, as for runs); or why there
    are none. `refusal` says why a host cannot run these replicas (its CPU lacks a kernel they
    need), or None: such a host is left out, and named in the answer when they do not fit.

    Replicas spread over hosts as a run's nodes do (a lost host then costs one replica, not
    all); the replicas that share a host share its supervisor and are numbered consecutively,
    from `first_replica` (a lost host's replicas placed again). A host that runs replicas of the
    deployment already is left out: one supervisor a host. A deployment waits in no queue: one
    that does not fit now fails, saying why."""
    with transaction.atomic():
        hosts = list(Host.objects.select_for_update().order_by("pk"))
        release_ended_claims(hosts)
        this = Pass(hosts)
        serving = set(DeviceClaim.objects.filter(deployment_id=deployment_id).values_list("host_id", flat=True))
        refused = {h.name: reason for h in this.ready.get(kind, []) if (reason := refusal(h)) is not None}
        ready = [h for h in this.ready.get(kind, []) if h.name not in refused and h.pk not in serving]
        gang = place(Need(nodes=replicas, per_node=per_replica), {kind: ready}, this.free)
        if gang is None:
            if per_replica == 1:
                free = sum(len(this.free[h.pk]) for h in ready)
                why = f"needs {devices_word(kind, replicas)} free on ready hosts, one per replica; {free} free now"
            else:
                room = sum(len(this.free[h.pk]) // per_replica for h in ready)
                why = (
                    f"needs {replicas} replicas × {devices_word(kind, per_replica)} free on one host each "
                    f"(tensor_parallel_size); the ready hosts have room for {room} now"
                )
            left_out = "; ".join(f"host {name}: {reason}" for name, reason in refused.items())
            return f"{why}; left out: {left_out}" if refused else why
        on_host: dict[int, list[int]] = defaultdict(list)
        by_id = {}
        for host, devices in gang:
            on_host[host.pk] += devices
            by_id[host.pk] = host
        groups, first = [], first_replica
        for host_id, devices in on_host.items():
            groups.append(ReplicaGroup(by_id[host_id], devices, first, per_replica))
            first += len(devices) // per_replica
        DeviceClaim.objects.bulk_create(
            DeviceClaim(host=g.host, device=device, deployment_id=deployment_id, node=g.first_replica + i // per_replica)
            for g in groups
            for i, device in enumerate(g.devices)
        )
    return groups
