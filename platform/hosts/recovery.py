"""What a lost host means for the runs placed on it: the loss of their nodes there.

A run whose other nodes still meet `nodes.min` goes on without them: its agents form a smaller
rendezvous by themselves, at the store on the control plane (`run_agents.start_store_here`: no host
of the run holds it, so node 0's host is lost like any other), and the control plane only records
the loss. A run left with fewer nodes than `nodes.min` is stopped and queued again to resume from
its last checkpoint (what it did since is replayed), and the scheduler starts it once its old
agents are gone and the cluster has room: on the hosts left, if they have room for its nodes.
Either way the `host_lost` event, and the reason of a run that cannot go on, name the lost host.
A run that goes on keeps the lost host's devices until it ends, so a host that comes back is not
given twice.
"""

from __future__ import annotations

from hosts.capacity import need_of
from hosts.models import DeviceClaim, Host
from launch import run_agents
from runs import services
from runs.models import Run


def do_handle_lost_host(host: Host) -> list[int]:
    """Records the loss on each active run placed on `host`; returns the runs queued again."""
    requeued = []
    for run in Run.objects.filter(device_claims__host=host, status__in=Run.ACTIVE).distinct():
        lost_nodes = sorted(set(DeviceClaim.objects.filter(run=run, host=host).values_list("node", flat=True)))
        nodes = need_of(run.spec).nodes
        minimum = int(run.spec.get("nodes", {}).get("min", nodes))
        left = nodes - len(lost_nodes)
        reason = f"host {host.name} lost: {left} of {nodes} nodes left, fewer than nodes.min={minimum}" if left < minimum else ""
        services.do_record_event(
            run, "host_lost",
            {"host": host.name, "address": host.address, "nodes": [f"node-{n}" for n in lost_nodes],
             "nodes_left": left, "continues": not reason, **({"reason": reason} if reason else {})},
        )  # fmt: skip
        if not reason:
            continue
        run_agents.request_cancel(run)  # the nodes left stop (while the run still holds its devices)
        if services.do_set_status(run, Run.Status.FAILED, reason, only_from=[run.status]):
            # From its last checkpoint, once its old agents are gone and the cluster has room.
            services.do_resume_run(run)
            requeued.append(run.pk)
    return requeued
