"""Who sees and who changes a run: its owner, and the members of its project.

A run outside any project is its owner's alone, as before projects. A run in a project is also
seen by the project's owner and members; the project's owner and its `write` members may also
change it (tags, note, cancel, resume). Everyone else gets the 404 of a run that does not exist.
Downloads and deployments of a run's checkpoints stay with the run's owner.

Every path that reads a run for a user (API, pages, websocket, compare) goes through
`visible_runs`; every change through `check_can_change`.
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet

from controlplane.exceptions import Forbidden, InvalidInput
from runs.models import Checkpoint, Project, ProjectMember, Run


def projects_of(user: Any) -> QuerySet[Project]:
    """The projects the user owns or is a member of."""
    return Project.objects.filter(Q(owner_id=user.pk) | Q(members__user_id=user.pk)).distinct()


def writable_projects(user: Any) -> QuerySet[Project]:
    """The projects the user may launch runs into and change runs of."""
    return Project.objects.filter(
        Q(owner_id=user.pk) | Q(members__user_id=user.pk, members__role=ProjectMember.Role.WRITE)
    ).distinct()


def visible_runs(user: Any, runs: QuerySet[Run] | None = None) -> QuerySet[Run]:
    runs = Run.objects.all() if runs is None else runs
    if not getattr(user, "is_authenticated", False):
        return runs.none()
    # A subquery, not a join through members: a run appears once however many members it has.
    shared = projects_of(user).values("pk")
    return runs.filter(Q(owner_id=user.pk) | Q(project__in=shared))


def visible_checkpoints(user: Any) -> QuerySet[Checkpoint]:
    return Checkpoint.objects.filter(run__in=visible_runs(user).values("pk"))


def can_change(user: Any, run: Run) -> bool:
    if run.owner_id == user.pk:
        return True
    return run.project_id is not None and writable_projects(user).filter(pk=run.project_id).exists()


def check_can_change(user: Any, run: Run) -> None:
    """403 for a member who may only read (they see the run, so a 404 would be a lie)."""
    if not can_change(user, run):
        raise Forbidden("You may read this run but not change it: your role in its project is read.")


def role_in(user: Any, project: Project) -> str:
    if project.owner_id == user.pk:
        return "owner"
    member = project.members.filter(user_id=user.pk).first()
    return member.role if member else ""


def check_project_for(user: Any, project: Project | None, run: Run | None = None) -> None:
    """A run goes into a project only by its owner, and only into one they may write to."""
    if run is not None and run.owner_id != user.pk:
        raise Forbidden("Only the run's owner moves it between projects.")
    if project is not None and not writable_projects(user).filter(pk=project.pk).exists():
        raise InvalidInput("project", f"project {project.pk} is not one you may add runs to (owner or write member)")


def check_project_owner(user: Any, project: Project) -> None:
    if project.owner_id != user.pk:
        raise Forbidden("Only the project's owner changes it and its members.")


def do_set_member(project: Project, username: str, role: str) -> ProjectMember:
    """Adds a member, or changes their role."""
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise InvalidInput("username", f"no user is named {username!r}")
    if user.pk == project.owner_id:
        raise InvalidInput("username", "the project's owner is not a member; they may do everything already")
    try:
        with transaction.atomic():
            member, _ = ProjectMember.objects.update_or_create(project=project, user=user, defaults={"role": role})
    except IntegrityError:  # two requests added them at once; the other one's row stands
        member = ProjectMember.objects.get(project=project, user=user)
    return member


def do_remove_member(project: Project, username: str) -> bool:
    deleted, _ = ProjectMember.objects.filter(project=project, user__username=username).delete()
    return deleted > 0
