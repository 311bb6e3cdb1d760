"""The head of the queue's reservation, and preemption.

The first run a pass cannot place holds in reserve the devices it will start on: the free ones,
and those of the running runs whose end it waits for, soonest first; the runs behind it start
only on what is left. A head of higher priority that cannot otherwise start asks lower-priority
runs to checkpoint and stop (`preemption`); the devices of the runs stopping for it come first in
its reservation.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db.models import F

from hosts.capacity import Need
from hosts.gang import place
from hosts.models import DeviceClaim, Host
from hosts.quotas import Queued
from runs.models import Run

# A run holding devices: when it should end (None: unknown), its id, its (host id, device) pairs.
Ending = tuple[datetime | None, int, list[tuple[int, int]]]


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
    ending: list[Ending],
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


def ending_runs(placed: dict[int, list[tuple[int, int, int]]], now: datetime) -> list[Ending]:
    """The runs holding devices, by when they should end (unknown last): the claims stored and
    those the pass made (`placed`: per run, its (host id, device, node) claims)."""
    held: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for run_id, host_id, device in DeviceClaim.objects.filter(run__isnull=False).values_list("run_id", "host_id", "device"):
        held[run_id].append((host_id, device))
    for run_id, claims in placed.items():
        held[run_id] += [(host_id, device) for host_id, device, _ in claims]
    progress = Run.objects.filter(pk__in=list(held)).values_list("pk", "started_at", "step", "spec__train__steps")
    ends = {pk: expected_end(started, step or 0, int(steps or 0), now) for pk, started, step, steps in progress}
    ending = [(ends.get(run_id), run_id, devices) for run_id, devices in held.items()]
    return sorted(ending, key=lambda e: (e[0] is None, e[0] or now, e[1]))


ACTIVE_PLACED = [Run.Status.STARTING, Run.Status.RUNNING, Run.Status.RESTARTING]


def preempting_for(head_id: int) -> set[int]:
    return set(Run.objects.filter(preempted_by_id=head_id, status__in=ACTIVE_PLACED).values_list("pk", flat=True))


def preemption(
    head: Queued, need: Need, kinds: Iterable[str], hosts: dict[str, list[Host]], free: dict[int, list[int]],
    ending: list[Ending],
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
