"""Gang placement: a queued run gets all its nodes' devices at once, or waits with a reason.

One pass (`schedule`) runs in one transaction. It locks every host row first (`select_for_update`
on PostgreSQL; on SQLite the transaction is IMMEDIATE, so it holds the database's write lock from
its start), so two schedulers take turns. Runs are offered the free devices in fair-share order
(`hosts.quotas`: higher `priority` first, then the share with the least recent use); a run over
its owner's or project's quota waits without blocking anyone. The first run that does not fit is
the head of the queue: it holds in reserve the devices it will start on, and the runs behind it
start only on what is left (backfill), so none delays it and a large run is not starved by
small ones. A run goes only to hosts of the device kind it asks for (`resources.device`) whose
labels match its selector (`resources.labels`). A placement is `DeviceClaim` rows, unique per
(host, device): whatever happens, no device is given twice. The claim and the run's move to
`starting` commit together; the caller then sends the start tasks.
"""

from __future__ import annotations

import functools
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone

from controlplane.bulk import insert_rows
from hosts import capacity
from hosts.capacity import Need, devices_word, gib, need_of, need_of_json, parsed_json, release, wanted_kinds
from hosts.gang import matching, place, waiting_reason
from hosts.models import DeviceClaim, Host, running_keys
from hosts.quotas import Policy, share_of
from hosts.reservation import ACTIVE_PLACED, Reservation, ending_runs, preempting_for, preemption, reserve
from runs.models import Run
from training.config import ResourcesConfig, SpecError
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
    """Gives back the devices of ended runs (`capacity.release`), of stopped and failed
    deployments and of replicas scaled away once nothing of them can hold them: their host is lost, or its last beat lists
    no agent or supervisor of theirs. Until then a device stays claimed, so no new work is
    placed where an old rank or replica may still run."""
    release()
    by_id = {h.pk: h for h in hosts}
    running = {h.pk: supervisors_on(h) for h in hosts}
    # A deployment's replicas past its count were scaled away (all of them, asleep).
    ended = DeviceClaim.objects.filter(
        Q(deployment__status__in=["stopped", "failed"]) | Q(deployment__isnull=False, node__gte=F("deployment__replicas"))
    )
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


def behind(head_id: int) -> str:
    """The reason of every run that waits behind the head of the queue and has none of its own
    (the head, a run over its quota, name theirs). It is not stored: a queue of thousands would
    cost as many row writes whenever the head changes. `shown_reason` says it when a run is read."""
    return f"waiting: behind run {head_id} at the head of the queue; the devices it leaves free do not fit this run"


def queue_head() -> int | None:
    """The run at the head of the queue: the queued run that holds a reservation (the pass gives
    the head one, with no devices in it if it waits for hosts, and clears every other's)."""
    return Run.objects.filter(status=Run.Status.QUEUED).exclude(reservation={}).values_list("pk", flat=True).first()


def shown_reason(status: str, stored: str, head: int | None) -> str:
    """A run's reason as pages and the API show it: its own, or for a queued run without one,
    that it waits behind the head (`head`: `queue_head()`, read once for many runs)."""
    if stored or status != Run.Status.QUEUED or head is None:
        return stored
    return behind(head)


class RunsSide(Protocol):
    """What a pass asks of the runs' side (`hosts.tasks.RUNS_SIDE`): placement decides and claims
    devices; a run's status and events are recorded by runs.services, and whether its earlier
    agents still run is the launch's to say."""

    def still_stopping(self, run: Run, running: set[str]) -> bool:
        """A queued run's earlier agents still stop: their last events must land first
        (`running`: the keys of what the hosts that are not lost run)."""
        ...

    def move_to_starting(self, placements: list[tuple[int, int, str, list[dict[str, Any]]]]) -> list[int]:
        """The placed runs' move to `starting` (each: its id, the `last_seq` the pass read, its
        rendezvous endpoint and nodes) and their events, inside the pass's transaction, in a few
        statements whatever their number; returns those that moved (not those that moved on
        since they were read)."""
        ...

    def note_waiting(self, run: Run, reason: str) -> bool: ...

    def note_waiting_many(self, reasons: Mapping[str, list[int]]) -> None:
        """Reasons of many queued runs (each: the runs it holds back), in one UPDATE and
        without an event each."""
        ...

    def preempt(self, run: Run, by: Run) -> bool:
        """Asks `run` to checkpoint and stop to make room for `by`; False if it was asked already."""
        ...

    def request_stop(self, run: Run) -> None:
        """Sends a preempted run's stop request again (it runs on: the request may be lost)."""
        ...


class Queued(NamedTuple):
    """What a pass reads of a queued run: a tuple, not a model (a queue of thousands), and of its
    spec only what placement needs, decided once per distinct spec (`_shape`)."""

    pk: int
    owner_id: int
    project_id: int | None
    priority: int
    resume: bool
    status_reason: str
    last_seq: int
    need: Need  # its nodes and devices per node
    wants: Wants  # the device kinds and host labels it may go to
    rank_memory_mb: dict[str, int]
    reservation: dict[str, Any]


def read_queue(cluster_has_gpus: bool) -> list[Queued]:
    # The JSON columns come as text and each distinct text is parsed once (`capacity.parsed_json`, `_shape`):
    # a queue of thousands has a few dozen shapes, and decoding every row's five fields was most
    # of a pass.
    text = functools.partial(Cast, output_field=TextField())
    rows = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False).values_list(
        "pk", "owner_id", "project_id", "priority", "resume", "status_reason", "last_seq",
        KT("spec__layout"), KT("spec__nodes"), KT("spec__resources"), text("rank_memory_mb"), text("reservation"),
    )  # fmt: skip
    return [
        Queued(pk, owner, project, priority, resume, reason, last_seq, *_shape(layout, nodes, resources, cluster_has_gpus),
               parsed_json(memory), parsed_json(held))  # fmt: skip
        for pk, owner, project, priority, resume, reason, last_seq, layout, nodes, resources, memory, held in rows
    ]


@functools.lru_cache(maxsize=4096)
def _shape(layout: str | None, nodes: str | None, resources: str | None, cluster_has_gpus: bool) -> tuple[Need, Wants]:
    return need_of_json(layout, nodes), Wants.of({"resources": parsed_json(resources)}, cluster_has_gpus)


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
        self.claims: dict[int, list[tuple[int, int, int]]] = {}  # per run placed: (host id, device, node)
        self.placements: list[tuple[int, int, str, list[dict[str, Any]]]] = []
        self.filled = 0  # hosts this pass filled since the candidate lists were last pruned
        self.all_ready = {kind: list(of_kind) for kind, of_kind in self.ready.items()}  # never pruned

    def rendezvous_endpoint(self, gang: list[tuple[Host, list[int]]]) -> str:
        """Where the run's agents meet: for one node, a port on its host, where its agent hosts
        the store; for several, a port on the control plane's machine, where the launcher starts
        the store (`run_agents.start_store_here`), so that no host of the run holds it. A port no
        active run's rendezvous holds, and on this machine one nothing listens on now."""
        address = settings.RENDEZVOUS_ADDRESS if len(gang) > 1 else gang[0][0].address
        taken = self.ports[address]
        ports = settings.RENDEZVOUS_PORTS
        # Most ports are free: a few random tries find one without listing the range each time.
        tries = [p for p in random.sample(ports, min(8, len(ports))) if str(p) not in taken]
        free = tries or [p for p in ports if str(p) not in taken]
        port = str(listen_port(free, host="") if len(gang) > 1 else free[0])
        taken.add(port)
        return f"{address}:{port}"

    def prune_full_hosts(self, lists: Iterable[list[Host]]) -> None:
        """Takes hosts with no free device out of `lists` (the candidate lists a pass keeps):
        placement then looks only at hosts that can still give something."""
        for hosts in lists:
            hosts[:] = [h for h in hosts if self.free[h.id]]
        self.filled = 0

    def claim(self, run: Queued, gang: list[tuple[Host, list[int]]]) -> None:
        """Gives the run its devices and rendezvous, for the pass's end to write."""
        endpoint = self.rendezvous_endpoint(gang)
        nodes = [
            {"node": node, "host": host.name, "address": host.address, "devices": devices}
            for node, (host, devices) in enumerate(gang)
        ]
        self.placements.append((run.pk, run.last_seq, endpoint, nodes))
        self.claims[run.pk] = []
        for node, (host, devices) in enumerate(gang):
            taken = set(devices)
            self.free[host.id] = [d for d in self.free[host.id] if d not in taken]
            self.filled += not self.free[host.id]
            self.claims[run.pk] += [(host.id, device, node) for device in devices]

    def write(self, runs: RunsSide) -> list[int]:
        """The placed runs' moves, claims and events; returns the runs that moved (one cancelled
        since the pass read it keeps no claim, and its devices are free for the next pass)."""
        moved = runs.move_to_starting(self.placements)
        now = connection.ops.adapt_datetimefield_value(timezone.now())
        # The unique (host, device) constraint refuses a device given twice right here.
        insert_rows(
            DeviceClaim, ["host", "device", "run", "node", "claimed_at"],
            ((host_id, device, run_id, node, now) for run_id in moved for host_id, device, node in self.claims[run_id]),
        )  # fmt: skip
        return moved


@dataclass(frozen=True)
class Wants:
    """Where a run may go: the device kinds it asks for (`resources.device`), in the order they
    are tried, and the host labels it selects (`resources.labels`)."""

    kinds: tuple[str, ...]
    selector: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, spec: dict[str, Any], cluster_has_gpus: bool) -> Wants:
        return cls(wanted_kinds(spec, cluster_has_gpus), _selector((spec.get("resources") or {}).get("labels", "")))

    def describe(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.selector)


@functools.lru_cache(maxsize=1024)
def _selector(labels: str) -> tuple[tuple[str, str], ...]:
    try:
        return tuple(sorted(ResourcesConfig(labels=labels).selector().items()))
    except SpecError:
        return ()  # checked at submit: a stored spec's selector is well formed


def schedule(runs: RunsSide) -> list[int]:
    """One placement pass; returns the runs placed (moved to `starting`), whose start tasks the
    caller sends.

    Runs are offered room in fair-share order (`hosts.quotas`): higher priority first, then the
    share (project, else owner) with the least recent use. A run whose owner or project is at its
    quota waits, naming it, and holds nothing. The first run that does not fit is the head of
    the queue: it reserves the devices it will start on (the free ones, and those of the running
    runs whose end it waits for, soonest first), and the runs behind it may start only on what
    is left (backfill): none of them can delay the head's start."""
    placed: list[int] = []
    with transaction.atomic():
        hosts = list(Host.objects.select_for_update().order_by("pk"))
        if not hosts:
            return placed
        # Devices of runs and deployments that ended go back once nothing of them runs.
        release_ended_claims(hosts)
        now = timezone.now()
        this = Pass(hosts)
        policy = Policy(hosts, now)
        names = {h.pk: h.name for h in hosts}
        has_gpus = any(h.device_kind == "gpu" for h in hosts)
        queue = read_queue(has_gpus)
        # What the hosts run, read once: whether a resumed run's earlier agents still stop.
        running = {key for h in hosts if h.status != Host.Status.LOST for key in running_keys(h.running)}
        candidates: dict[tuple[Any, ...], dict[str, list[Host]]] = {((), ()): this.ready}
        # The least device memory a ready host of each kind reports (hosts that report none hold anything).
        smallest = {
            kind: min((mb for h in of_kind if (mb := capacity.device_memory_mb(h))), default=2**62)
            for kind, of_kind in this.ready.items()
        }  # fmt: skip
        failed: set[tuple[Need, tuple[Any, ...], tuple[str, ...]]] = set()  # free devices only shrink in a pass
        head: Queued | None = None
        reservation: Reservation | None = None
        own_reasons: dict[int, str] = {}  # the head's, and those of runs that wait for a reason of their own
        for run in policy.fair_order(queue):
            if run.resume and runs.still_stopping(Run.objects.get(pk=run.pk), running):
                own_reasons[run.pk] = "waiting: its previous agents are still stopping"
                continue
            need, wants = run.need, run.wants
            kinds, over_quota = policy.kinds_allowed(run, need.total, wants.kinds)
            if not kinds:
                own_reasons[run.pk] = over_quota
                continue
            # Only a run whose ranks need more than some ready device holds has hosts left out.
            memory = run.rank_memory_mb or {}
            big = tuple(sorted((k, mb) for k, mb in memory.items() if mb > smallest.get(k, 2**62) and k in kinds))
            key = (wants.selector, big)
            if key not in candidates:
                candidates[key] = matching(this.ready, wants.selector, big)
            if this.filled * 20 > len(hosts):
                # (The ready lists are candidates' first entry: the reservation's free devices
                # are on hosts that stay.)
                this.prune_full_hosts([lst for by_kind in candidates.values() for lst in by_kind.values()])
            hosts_for = candidates[key]
            shape = (need, key, tuple(kinds))
            gang = None if shape in failed else place(need, hosts_for, this.free, kinds)
            if gang is not None:
                this.claim(run, gang)
                policy.took(run, gang[0][0].device_kind, need.total)
                continue
            failed.add(shape)
            if head is not None:
                continue  # behind the head: it waits for room the head leaves
            head = run
            # Every host that matches, full ones too (the candidate lists leave those out): the
            # head waits for devices that others hold now.
            hosts_for = matching(this.all_ready, wants.selector, big)
            reason = waiting_reason(need, hosts_for, this.free, kinds)
            if wants.selector:
                reason += f" on hosts labelled {wants.describe()}"
            if big:
                reason += f", of hosts whose devices hold one of its ranks ({', '.join(f'{gib(mb)} on a {k.upper()}' for k, mb in big)})"
            ending = ending_runs(this.claims, now)
            victims = preemption(run, need, kinds, hosts_for, this.free, ending)
            if victims:
                head_run = Run.objects.get(pk=run.pk)
                for victim in victims:
                    runs.preempt(victim, head_run)
            # The runs asked to stop end first: the head holds their devices in reserve.
            stopping = {v.pk for v in victims} | preempting_for(run.pk)
            ending.sort(key=lambda e: e[1] not in stopping)
            reservation = reserve(run.pk, need, kinds, hosts_for, this.free, ending)
            if reservation is not None:
                reason += f"; {reservation.describe(names)}"
                for host_id, device in reservation.devices:
                    if device in this.free[host_id]:
                        this.free[host_id] = [d for d in this.free[host_id] if d != device]
            own_reasons[run.pk] = reason
        placed = this.write(runs)
        _write_reasons(runs, queue, placed, own_reasons, head, reservation, names)
        for preempted in Run.objects.filter(status__in=ACTIVE_PLACED, preempted_by__isnull=False):
            runs.request_stop(preempted)  # until it stops: a request may be lost, or come before its agent started
    return placed


def _write_reasons(
    runs: RunsSide, queue: list[Queued], placed: list[int], own_reasons: dict[int, str], head: Queued | None,
    reservation: Reservation | None, names: dict[int, str],
) -> None:  # fmt: skip
    """Each waiting run's reason and reservation, decided here from what the pass read and
    written only where they change (a pass that changes nothing writes nothing): the head's
    reason with a `waiting` event, and its reservation (a head that holds nothing has an empty
    one, which still marks it); a quota's reason in one UPDATE for the runs it holds back. The
    runs behind the head store none (`shown_reason`)."""
    moved = set(placed)
    texts: dict[str, list[int]] = defaultdict(list)
    for run in queue:
        if run.pk in moved:
            continue
        reason = own_reasons.get(run.pk, "")  # none of its own: behind the head (`shown_reason`)
        if reason == run.status_reason:
            continue
        if head is not None and run.pk == head.pk or reason.startswith("waiting: its previous agents"):
            runs.note_waiting(Run.objects.get(pk=run.pk), reason)  # with a `waiting` event
        else:
            texts[reason].append(run.pk)  # a quota's, or the one behind the head
    runs.note_waiting_many(texts)
    held = reservation.as_json(names) if reservation is not None else {"devices": [], "until": [], "expected_at": None}
    # Only queued runs hold a reservation (a placed one's is cleared as it moves to starting).
    stale = [run.pk for run in queue if run.reservation and (head is None or run.pk != head.pk) and run.pk not in moved]
    if stale:
        Run.objects.filter(pk__in=stale).update(reservation={})
    if head is not None and head.reservation != held:
        Run.objects.filter(pk=head.pk).update(reservation=held)


def queue_order() -> list[dict[str, Any]]:
    """The queued runs in the order the next pass offers them room (the order it takes when each
    run fits: a placed run adds its slots to its share's score), with what orders them and why
    each waits."""
    hosts = list(Host.objects.all())
    policy = Policy(hosts, timezone.now())
    has_gpus = any(h.device_kind == "gpu" for h in hosts)
    queue = list(Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False).select_related("owner", "project"))
    entries = []
    for position, run in enumerate(policy.fair_order(queue), start=1):
        need, wants = need_of(run.spec), Wants.of(run.spec, has_gpus)
        share = share_of(run.owner_id, run.project_id)
        needs = " or ".join(devices_word(kind, need.total) for kind in wants.kinds)
        if need.nodes > 1:
            needs += f" ({need.nodes} nodes × {need.per_node})"
        if wants.selector:
            needs += f" on hosts labelled {wants.describe()}"
        policy.took(run, wants.kinds[0], need.total)  # as if it were placed: the pass's order when all fit
        entries.append({
            "position": position, "run": run, "share": f"project {run.project.name}" if run.project else f"user {run.owner.username}",
            "share_recent_slots": round(policy.use.get(share, 0.0), 3), "needs": needs,
        })  # fmt: skip
    return entries
