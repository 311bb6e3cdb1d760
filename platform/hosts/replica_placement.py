"""Replica placement: devices for a deployment's replicas, claimed in one transaction with the
host rows locked, as a run's are; a deployment waits in no queue."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction

from hosts.capacity import Need, devices_word
from hosts.gang import place
from hosts.models import DeviceClaim, Host
from hosts.scheduling import Pass, release_ended_claims


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
