"""Team policy on a shared cluster: quotas, the priority ceiling and fair share.

- A quota (`hosts.models.Quota`) limits what a user's runs, or a project's, hold at once (GPUs,
  CPU slots: the devices of their claims, an ended run's included until they are given back) and
  how many may wait in the queue. A run in a project counts against its owner's quota and the
  project's. Staff set quotas; a user or project without one has no limit.
- The priority ceiling bounds `priority` at submit: a user's quota row sets it, else
  `settings.DEFAULT_PRIORITY_CEILING` (0: one level for everybody); staff have none.
- Fair share orders the runs of one priority. A run's share is its project, else its owner; the
  share with the least recent use goes first, and a share's runs in the order they were
  submitted. Recent use is the share's runs' slot-seconds, each second weighted down by half per
  half-life H (`settings.FAIR_SHARE_HALF_LIFE_HOURS`):

      use(K)   = Σ over K's runs of  slots × ∫ 2^(-(now - t) / H) dt   over the time it ran
      score(K) = use(K) × ln 2 / H  +  the slots this pass has placed for K

  `use × ln 2 / H` is the exponentially weighted mean of the slots K held (a share that held s
  slots for long scores s), so GPUs and CPU slots count alike. The second term makes one pass
  alternate between shares instead of starting every run of the least-used share first.

Only the models are imported here (as in `hosts.capacity`): `runs.services` checks a submit
against the quota, and the scheduler asks the rest.
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from django.conf import settings
from django.db.models import Q
from django.db.models.fields.json import KT

from controlplane.exceptions import InvalidInput
from hosts.capacity import devices_word, need_of_json
from hosts.models import DeviceClaim, Host, Quota
from runs.models import Project, Run

Share = tuple[str, int]  # ("project", id) or ("user", id)


class Queued(Protocol):
    """What policy reads of a queued run (a `Run`, or the scheduler's lighter tuple of one)."""

    @property
    def pk(self) -> int: ...
    @property
    def owner_id(self) -> int: ...
    @property
    def project_id(self) -> int | None: ...
    @property
    def priority(self) -> int: ...


QueuedRun = TypeVar("QueuedRun", bound=Queued)


def share_of(owner_id: int, project_id: int | None) -> Share:
    return ("project", project_id) if project_id is not None else ("user", owner_id)


def priority_ceiling(user: Any) -> int | None:
    """The highest priority `user` may submit; None: no ceiling (staff)."""
    if user.is_staff:
        return None
    own = Quota.objects.filter(user=user).values_list("priority_ceiling", flat=True).first()
    return settings.DEFAULT_PRIORITY_CEILING if own is None else own


def check_submit(owner: Any, project: Project | None, priority: int) -> None:
    """Refuses a priority above the owner's ceiling, and a run beyond a queue cap (the owner's
    or the project's), naming the field and the limit."""
    ceiling = priority_ceiling(owner)
    if ceiling is not None and priority > ceiling:
        raise InvalidInput("priority", f"must be at most {ceiling}, your ceiling (staff set it); got {priority}")
    caps = Quota.objects.filter(Q(user=owner) | Q(project=project) if project is not None else Q(user=owner))
    for quota in caps.exclude(queued_runs__isnull=True):
        cap = quota.queued_runs or 0
        waiting = Run.objects.filter(status=Run.Status.QUEUED)
        waiting = waiting.filter(owner=owner) if quota.user_id else waiting.filter(project=project)
        count = waiting.count()
        if count >= cap:
            whose = "your runs" if quota.user_id or project is None else f"the runs of project {project.name!r}"
            raise InvalidInput(
                "quota", f"{count} of {cap} queued runs allowed for {whose} already wait; "
                "cancel one or wait until one starts",
            )  # fmt: skip


@dataclass(frozen=True)
class Limit:
    gpus: int | None
    cpu_slots: int | None

    def of(self, kind: str) -> int | None:
        return self.gpus if kind == "gpu" else self.cpu_slots


class Policy:
    """What one scheduling pass knows of quotas and shares: each user's and project's devices
    held by kind, their limits, and each share's fair-share score; it follows the pass's claims."""

    def __init__(self, hosts: list[Host], now: datetime) -> None:
        self.kind_of = {h.pk: h.device_kind for h in hosts}
        self.limits: dict[Share, Limit] = {}
        for user_id, project_id, gpus, cpu_slots in Quota.objects.values_list("user_id", "project_id", "gpus", "cpu_slots"):
            if gpus is not None or cpu_slots is not None:
                self.limits[share_of(user_id, project_id)] = Limit(gpus, cpu_slots)
        self.held: dict[Share, Counter[str]] = defaultdict(Counter)
        for host_id, owner_id, project_id in DeviceClaim.objects.filter(run__isnull=False).values_list(
            "host_id", "run__owner_id", "run__project_id"
        ):
            for holder in self._holders(owner_id, project_id):
                self.held[holder][self.kind_of.get(host_id, "cpu")] += 1
        self.use = recent_use(now)
        self.placed: Counter[Share] = Counter()
        self.project_names: dict[int, str] = {}

    @staticmethod
    def _holders(owner_id: int, project_id: int | None) -> list[Share]:
        return [("user", owner_id)] + ([("project", project_id)] if project_id is not None else [])

    def kinds_allowed(self, run: Queued, count: int, kinds: Iterable[str]) -> tuple[list[str], str]:
        """Of `kinds`, those in which `count` more devices keep the run's owner and project
        within their quotas; and, when none does, the reason."""
        allowed, reason = [], ""
        for kind in kinds:
            over = self._over(run, kind, count)
            if over:
                reason = reason or over
            else:
                allowed.append(kind)
        return allowed, reason

    def _over(self, run: Queued, kind: str, count: int) -> str:
        for holder in self._holders(run.owner_id, run.project_id):
            limit = self.limits.get(holder)
            cap = limit.of(kind) if limit else None
            if cap is None:
                continue
            held = self.held[holder][kind]
            if held + count > cap:
                whose = "your runs" if holder[0] == "user" else f"the runs of project {self._project_name(holder[1])}"
                word = "GPUs" if kind == "gpu" else "CPU slots"
                return f"quota: {held} of {cap} {word} in use by {whose}; this run needs {devices_word(kind, count)}"
        return ""

    def _project_name(self, project_id: int) -> str:
        if project_id not in self.project_names:
            self.project_names[project_id] = Project.objects.filter(pk=project_id).values_list("name", flat=True).first() or str(project_id)
        return repr(self.project_names[project_id])

    def took(self, run: Queued, kind: str, count: int) -> None:
        for holder in self._holders(run.owner_id, run.project_id):
            self.held[holder][kind] += count
        self.placed[share_of(run.owner_id, run.project_id)] += count

    def score(self, share: Share) -> float:
        return self.use.get(share, 0.0) + self.placed[share]

    def fair_order(self, queue: Sequence[QueuedRun]) -> Iterator[QueuedRun]:
        """The queue as the pass offers it room: higher priority first; within a priority, the
        share with the lowest score, its oldest run. Scores are read again as the pass places
        runs (they only grow), so the order follows what was placed."""
        levels: dict[int, dict[Share, deque[QueuedRun]]] = defaultdict(lambda: defaultdict(deque))
        for run in sorted(queue, key=lambda r: r.pk):  # submission order: ids grow as runs are submitted
            levels[run.priority][share_of(run.owner_id, run.project_id)].append(run)
        for priority in sorted(levels, reverse=True):
            shares = levels[priority]
            heap = [(self.score(k), runs[0].pk, k) for k, runs in shares.items()]
            heapq.heapify(heap)
            while heap:
                score, pk, share = heapq.heappop(heap)
                if (now := self.score(share)) > score:
                    heapq.heappush(heap, (now, pk, share))
                    continue
                runs = shares[share]
                yield runs.popleft()
                if runs:
                    heapq.heappush(heap, (self.score(share), runs[0].pk, share))


def recent_use(now: datetime) -> dict[Share, float]:
    """Each share's exponentially weighted mean of the slots its runs held (the module's
    formula), from the runs that ran within ten half-lives (older ones weigh < 0.1%)."""
    half_life = settings.FAIR_SHARE_HALF_LIFE_HOURS * 3600.0
    since = now - timedelta(seconds=10 * half_life)
    ran = Run.objects.filter(started_at__isnull=False).filter(Q(finished_at__isnull=True) | Q(finished_at__gte=since))
    use: dict[Share, float] = defaultdict(float)
    for owner_id, project_id, started, finished, layout, nodes in ran.values_list(
        "owner_id", "project_id", "started_at", "finished_at", KT("spec__layout"), KT("spec__nodes")
    ):
        if started is None:
            continue  # (filtered out above: for the type checker)
        slots = need_of_json(layout, nodes).total
        ended_ago = max((now - (finished or now)).total_seconds(), 0.0)
        began_ago = max((now - started).total_seconds(), ended_ago)
        # slots × ∫ 2^(-age/H) d(age) from ended_ago to began_ago, times ln 2 / H: the closed form.
        use[share_of(owner_id, project_id)] += slots * (2 ** (-ended_ago / half_life) - 2 ** (-began_ago / half_life))
    return dict(use)


def _usage(holder: Share, kind_of: dict[int, str]) -> dict[str, dict[str, int | None]]:
    runs = Run.objects.filter(project_id=holder[1]) if holder[0] == "project" else Run.objects.filter(owner_id=holder[1])
    held: Counter[str] = Counter()
    for (host_id,) in DeviceClaim.objects.filter(run__in=runs).values_list("host_id"):
        held[kind_of.get(host_id, "cpu")] += 1
    quota = Quota.objects.filter(**{holder[0]: holder[1]}).first()
    return {
        "gpus": {"limit": quota.gpus if quota else None, "in_use": held["gpu"]},
        "cpu_slots": {"limit": quota.cpu_slots if quota else None, "in_use": held["cpu"]},
        "queued_runs": {"limit": quota.queued_runs if quota else None, "in_use": runs.filter(status=Run.Status.QUEUED).count()},
    }


def quota_of(user: Any, projects: Iterable[Project]) -> dict[str, Any]:
    """What `user` may submit and hold, and holds now; and the same of those of `projects` that
    have a quota (with whether their runs may be preempted)."""
    projects = list(projects)  # (a QuerySet would be read twice)
    kind_of = {h.pk: h.device_kind for h in Host.objects.all()}
    limited = {q.project_id: q for q in Quota.objects.filter(project__in=projects)}
    return {
        "priority_ceiling": priority_ceiling(user),
        "user": _usage(("user", user.pk), kind_of),
        "projects": [
            {"id": p.pk, "name": p.name, "preemptible": limited[p.pk].preemptible, **_usage(("project", p.pk), kind_of)}
            for p in projects if p.pk in limited
        ],  # fmt: skip
    }
