"""What a lost host means for the runs placed on it: the loss of their nodes there.

A run whose other nodes still meet `nodes.min` goes on without them (its agents form a smaller
rendezvous by themselves; the control plane only records it), unless the host held node 0: the
run's rendezvous store runs there (`launcher.store_key`'s process), and the agents left cannot meet
without it. A run that cannot go on is stopped and queued again to resume from its last
checkpoint (or snapshot-free: what it did since is replayed), and the scheduler starts it, with
a new store, once its old agents are gone and the cluster has room: on the hosts left, if they
have room for its nodes. Its reason names the lost host. A run that goes on keeps the lost
host's devices until it ends, so a host that comes back is not given twice.

The agents of node 0's survivors may notice first: the store's connection drops at once, and
they report the run failed ("rendezvous: RendezvousConnectionError"), seconds before the host
is marked lost. Such a run is queued again the same way when its node 0's host is.
"""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from hosts.capacity import need_of
from hosts.models import DeviceClaim, Host
from runs import launcher, services
from runs.models import Run

# How long after a run's agents reported its store gone its node 0's host may be marked lost
# (FATHOM_HOST_LOST_AFTER is 15 s by default, the beat task's interval adds a few).
STORE_LOSS_WINDOW = timedelta(minutes=5)


def do_handle_lost_host(host: Host) -> list[int]:
    """Records the loss on each run placed on `host` (active, or failed by the loss of the store
    it held); returns the runs queued again."""
    requeued = []
    for run in Run.objects.filter(device_claims__host=host, status__in=Run.ACTIVE).distinct():
        lost_nodes = sorted(set(DeviceClaim.objects.filter(run=run, host=host).values_list("node", flat=True)))
        nodes = need_of(run.spec).nodes
        minimum = int(run.spec.get("nodes", {}).get("min", nodes))
        left = nodes - len(lost_nodes)
        if 0 in lost_nodes:
            reason = f"host {host.name} lost with node 0, which held the run's rendezvous store"
        elif left < minimum:
            reason = f"host {host.name} lost: {left} of {nodes} nodes left, fewer than nodes.min={minimum}"
        else:
            reason = ""
        services.do_record_event(
            run, "host_lost",
            {"host": host.name, "address": host.address, "nodes": [f"node-{n}" for n in lost_nodes],
             "nodes_left": left, "continues": not reason, **({"reason": reason} if reason else {})},
        )  # fmt: skip
        if not reason:
            continue
        launcher.request_cancel(run)  # the nodes left stop (while the run still holds its devices)
        if services.do_set_status(run, Run.Status.FAILED, reason, only_from=[run.status]):
            # From its last checkpoint, once its old agents are gone and the cluster has room.
            services.do_resume_run(run)
            requeued.append(run.pk)
    for run in Run.objects.filter(
        status=Run.Status.FAILED, status_reason__startswith=STORE_GONE, finished_at__gte=timezone.now() - STORE_LOSS_WINDOW
    ):
        if _node0_host(run) != host.name:
            continue
        reason = f"host {host.name} lost with node 0, which held the run's rendezvous store"
        services.do_record_event(run, "host_lost", {
            "host": host.name, "address": host.address, "nodes": ["node-0"], "continues": False, "reason": reason,
        })  # fmt: skip
        Run.objects.filter(pk=run.pk).update(status_reason=reason)
        services.do_resume_run(run)
        requeued.append(run.pk)
    return requeued


# What a node agent reports when the run's rendezvous store stopped answering.
STORE_GONE = "rendezvous: RendezvousConnectionError"


def _node0_host(run: Run) -> str | None:
    placed = run.events.filter(kind="placed").order_by("-seq").first()
    nodes = placed.data.get("nodes", []) if placed is not None else []
    return next((n["host"] for n in nodes if n.get("node") == 0), None)
