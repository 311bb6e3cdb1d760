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
import heapq
import json
import random
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple, Protocol

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, TextField
from django.db.models.fields.json import KT
from django.db.models.functions import Cast
from django.utils import timezone

from controlplane.bulk import insert_rows
from hosts import capacity
from hosts.capacity import KINDS, Need, devices_word, gib, holds_rank, need_of, need_of_json, release, wanted_kinds
from hosts.models import DeviceClaim, Host
from hosts.quotas import Policy, share_of
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


def place(
    need: Need, hosts: dict[str, list[Host]], free: dict[int, list[int]], kinds: Iterable[str] = KINDS
) -> list[tuple[Host, list[int]]] | None:
    """A host and `need.per_node` free devices for each of the run's nodes, all of one kind, or None.

    `hosts`: the ready hosts by kind. Nodes go to distinct hosts while there are hosts to spread
    over (a lost host then costs the run one node), and only then share one. Among those that
    hold a node, the host with the fewest free devices is taken (best fit), so large holes stay
    for large runs. The `kinds` are tried in order (GPU hosts before CPU hosts)."""
    # (`id`, a plain attribute, not `pk`, a property: this runs for every host for every run.)
    per_node = need.per_node
    for kind in kinds:
        fits = [(count, h.name, h) for h in hosts.get(kind, ()) if (count := len(free[h.id])) >= per_node]
        if len(fits) >= need.nodes:
            # Enough hosts for one node each: the best fits, fewest free devices first (names
            # are unique, so hosts themselves are never compared).
            return [(h, free[h.id][:per_node]) for _, _, h in heapq.nsmallest(need.nodes, fits)]
        if sum(count // per_node for count, _, _ in fits) < need.nodes:
            continue
        # Fewer hosts than nodes: each host once, best fit first, then again where room is left.
        left = {h.id: free[h.id] for _, _, h in fits}
        by_id = {h.id: h for _, _, h in fits}
        gang: list[tuple[Host, list[int]]] = []
        used: set[int] = set()
        for _ in range(need.nodes):
            chosen = min(
                (i for i, devices in left.items() if len(devices) >= per_node),
                key=lambda i: (i in used, len(left[i]), by_id[i].name),
            )
            gang.append((by_id[chosen], left[chosen][:per_node]))
            left[chosen] = left[chosen][per_node:]
            used.add(chosen)
        return gang
    return None


def waiting_reason(need: Need, hosts: dict[str, list[Host]], free: dict[int, list[int]], kinds: Iterable[str] = KINDS) -> str:
    for kind in kinds:
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
    return f"waiting: no ready {' or '.join(k.upper() for k in kinds)} host"


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

    def still_stopping(self, run: Run) -> bool:
        """A queued run's earlier agents still stop: their last events must land first."""
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
    spec only what placement needs, decided once per distinct spec (`_wants_of`)."""

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
    # The JSON columns come as text and each distinct text is parsed once (`_parsed`, `_shape`):
    # a queue of thousands has a few dozen shapes, and decoding every row's five fields was most
    # of a pass.
    text = functools.partial(Cast, output_field=TextField())
    rows = Run.objects.filter(status=Run.Status.QUEUED, cancel_requested=False).values_list(
        "pk", "owner_id", "project_id", "priority", "resume", "status_reason", "last_seq",
        KT("spec__layout"), KT("spec__nodes"), KT("spec__resources"), text("rank_memory_mb"), text("reservation"),
    )  # fmt: skip
    return [
        Queued(pk, owner, project, priority, resume, reason, last_seq, *_shape(layout, nodes, resources, cluster_has_gpus),
               _parsed(memory), _parsed(held))  # fmt: skip
        for pk, owner, project, priority, resume, reason, last_seq, layout, nodes, resources, memory, held in rows
    ]


@functools.lru_cache(maxsize=4096)
def _parsed(text: str | None) -> Any:
    """A JSON text's value ({} for none). Shared by every run whose field reads the same: readers
    of a `Queued` never change what it holds."""
    return json.loads(text) if text else {}


@functools.lru_cache(maxsize=4096)
def _shape(layout: str | None, nodes: str | None, resources: str | None, cluster_has_gpus: bool) -> tuple[Need, Wants]:
    return need_of_json(layout, nodes), Wants.of({"resources": _parsed(resources)}, cluster_has_gpus)


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


@dataclass
class Reservation:
    """The devices the head of the queue will start on, held back from every run behind it:
    the free ones now, and those of the running runs whose end it waits for."""

    run_id: int
    devices: set[tuple[int, int]]  # (host id, device)
    until: list[int]  # the runs whose end frees the rest
    expected_at: datetime | None  # when the last of them is expected to end; None: unknown

    def as_json(self, names: dict[int, str]) -> dict[str, Any]:
        return {
            "devices": sorted(f"{names[h]}:{d}" for h, d in self.devices),
            "until": self.until,
            "expected_at": self.expected_at.replace(second=0, microsecond=0).isoformat() if self.expected_at else None,
        }

    def describe(self, names: dict[int, str]) -> str:
        shown = ", ".join(self.as_json(names)["devices"])
        if not self.until:
            return f"holds {shown} in reserve"
        # (Not when: the reason is written, with an event, only when it changes, and the expected
        # time moves with every pass; `Run.reservation` has it, to the minute.)
        runs = f"run{'s' if len(self.until) > 1 else ''} {', '.join(map(str, self.until))} end{'' if len(self.until) > 1 else 's'}"
        return f"holds {shown} in reserve until {runs}"


def expected_end(started_at: datetime | None, step: int, steps: int, now: datetime) -> datetime | None:
    """When a running run should end at the pace it has kept; None before its first step."""
    if started_at is None or step <= 0 or steps <= 0:
        return None
    per_step = (now - started_at).total_seconds() / step
    return now + timedelta(seconds=per_step * max(steps - step, 0))


def reserve(
    run_id: int, need: Need, kinds: Iterable[str], hosts: dict[str, list[Host]], free: dict[int, list[int]],
    ending: list[tuple[datetime | None, int, list[tuple[int, int]]]],
) -> Reservation | None:  # fmt: skip
    """The head run's reservation: the fewest of the `ending` runs (by expected end, unknown
    last) whose devices, with the free ones, hold its gang, and the gang placed on them. None
    when even all of them ending would not make room (it waits for hosts, and holds nothing)."""
    kinds = tuple(kinds)

    def gang_after(count: int) -> list[tuple[Host, list[int]]] | None:
        freed: dict[int, list[int]] = defaultdict(list)
        for _, _, devices in ending[:count]:
            for host_id, device in devices:
                freed[host_id].append(device)
        return place(need, hosts, {h: sorted(free[h] + freed.get(h, [])) for h in free}, kinds)

    if gang_after(len(ending)) is None:
        return None
    low, high = 0, len(ending)  # placing only gets easier as more runs end: the fewest by bisection
    while low < high:
        middle = (low + high) // 2
        if gang_after(middle) is None:
            low = middle + 1
        else:
            high = middle
    gang = gang_after(low)
    assert gang is not None
    waited = ending[:low]
    ends = [end for end, _, _ in waited]
    expected_at = None if None in ends else max(ends, default=None)  # type: ignore[type-var]
    devices = {(host.id, device) for host, chosen in gang for device in chosen}
    return Reservation(run_id, devices, [run for _, run, _ in waited], expected_at)


def _ending_runs(this: Pass, now: datetime) -> list[tuple[datetime | None, int, list[tuple[int, int]]]]:
    """The runs holding devices, by when they should end (unknown last): the claims stored and
    those this pass made."""
    held: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for run_id, host_id, device in DeviceClaim.objects.filter(run__isnull=False).values_list("run_id", "host_id", "device"):
        held[run_id].append((host_id, device))
    for run_id, claims in this.claims.items():
        held[run_id] += [(host_id, device) for host_id, device, _ in claims]
    progress = Run.objects.filter(pk__in=list(held)).values_list("pk", "started_at", "step", "spec__train__steps")
    ends = {pk: expected_end(started, step or 0, int(steps or 0), now) for pk, started, step, steps in progress}
    ending = [(ends.get(run_id), run_id, devices) for run_id, devices in held.items()]
    return sorted(ending, key=lambda e: (e[0] is None, e[0] or now, e[1]))


def matching(
    by_kind: dict[str, list[Host]], selector: tuple[tuple[str, str], ...], memory: tuple[tuple[str, int], ...]
) -> dict[str, list[Host]]:
    """Of `by_kind`, the hosts whose labels match `selector` and whose devices hold a rank that
    needs `memory` ((kind, MB) pairs)."""
    need = dict(memory)
    return {
        kind: [h for h in hosts if all(h.labels.get(k) == v for k, v in selector) and holds_rank(h, need)]
        for kind, hosts in by_kind.items()
    }


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
            if run.resume and runs.still_stopping(Run.objects.get(pk=run.pk)):
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
            ending = _ending_runs(this, now)
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


ACTIVE_PLACED = [Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING]


def preempting_for(head_id: int) -> set[int]:
    return set(Run.objects.filter(preempted_by_id=head_id, status__in=ACTIVE_PLACED).values_list("pk", flat=True))


def preemption(
    head: Queued, need: Need, kinds: Iterable[str], hosts: dict[str, list[Host]], free: dict[int, list[int]],
    ending: list[tuple[datetime | None, int, list[tuple[int, int]]]],
) -> list[Run]:  # fmt: skip
    """The running runs of lower priority the head asks to checkpoint and stop so that it can
    start: none if it would fit once the runs already stopping for it are gone; else the fewest,
    lowest priority first, then the most recently started (least progress since their last
    checkpoint), of runs whose project allows preemption. Empty when even all of them would not
    make room (it waits, and stops nobody)."""
    kinds = tuple(kinds)
    devices = {run_id: held for _, run_id, held in ending}

    def fits(stopped: Iterable[int]) -> bool:
        freed: dict[int, list[int]] = defaultdict(list)
        for run_id in stopped:
            for host_id, device in devices.get(run_id, []):
                freed[host_id].append(device)
        return place(need, hosts, {h: free[h] + freed.get(h, []) for h in free}, kinds) is not None

    already = preempting_for(head.pk)
    if fits(already):
        return []
    candidates = list(
        Run.objects.filter(pk__in=list(devices), status__in=ACTIVE_PLACED, priority__lt=head.priority, preempted_by__isnull=True)
        .exclude(project__quota__preemptible=False)
        .order_by("priority", F("started_at").desc(nulls_first=True), "-pk")
    )
    chosen: list[Run] = []
    for candidate in candidates:
        chosen.append(candidate)
        if fits(already | {c.pk for c in chosen}):
            break
    else:
        return []
    # The last one added made room; drop any earlier one it made needless.
    for candidate in list(chosen[:-1]):
        if fits(already | {c.pk for c in chosen if c is not candidate}):
            chosen.remove(candidate)
    return chosen


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
