"""Where a gang fits: a host and devices for each of a run's nodes (or a deployment's replicas),
from the free devices a pass knows, and why it does not fit. Pure functions of hosts and free
lists: the pass (`hosts.scheduling`), the head's reservation and preemption (`hosts.reservation`)
and replica placement (`hosts.replica_placement`) all ask them.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from hosts.capacity import KINDS, Need, devices_word, holds_rank
from hosts.models import Host


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
