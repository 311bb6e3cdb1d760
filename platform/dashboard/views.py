"""The dashboard's pages. Each renders a shell; the page's ES module fills it from the REST API
and the websockets, so the browser and scripts see the same data through the same checks.

Pages that name an object look it up among the caller's own (for a run: also those of the
caller's projects, runs.access), so anyone else's run or deployment answers 404 here as it does
in the API.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import get_object_or_404, render

from controlplane.exceptions import InvalidInput
from dashboard.launch_form import groups_for
from deployments.models import Deployment
from notifications.models import Webhook
from runs import access, compare
from runs.models import ProjectMember, Run, RunEvent
from training.config import RECIPES
from training.planner.hardware import DEVICES

# A sparkline is a few dozen pixels wide; more points than this only cost bytes.
SPARKLINE_POINTS = 60
# The runs list asks for at most this many sparklines at once (one page of the API's list).
SPARKLINE_RUNS = 100
# Deliveries shown per webhook on its settings page; the API lists more.
WEBHOOK_DELIVERIES_SHOWN = 10
# The autoscaler's decisions and what followed them, newest first, on a deployment's page.
SCALING_EVENTS = ("scaled", "scale_blocked", "asleep", "waking", "autoscaling")
SCALING_DECISIONS_SHOWN = 10


@login_required
def runs_page(request: HttpRequest) -> HttpResponse:
    projects = list(access.projects_of(request.user).values("id", "name"))
    return render(
        request, "dashboard/runs.html", {"statuses": Run.Status.values, "recipes": list(RECIPES), "projects": projects}
    )


@login_required
def hosts_page(request: HttpRequest) -> HttpResponse:
    return render(
        request, "dashboard/hosts.html",
        {"lost_after": int(settings.HOST_LOST_AFTER_SECONDS), "staff": request.user.is_staff},
    )  # fmt: skip


@login_required
def queue_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/queue.html")


@login_required
def run_new_page(request: HttpRequest) -> HttpResponse:
    # The recipes' own values become the placeholders of the form's inputs, so an empty input
    # visibly means "the recipe's value" and the API fills it in.
    recipes = {
        name: {
            section: values
            for section, values in make().to_dict().items()
            if section in ("model", "layout", "train", "nodes")
        }
        for name, make in RECIPES.items()
    }
    # The planner's hardware, this machine's kind first: the layout check asks about one of them.
    devices = sorted(DEVICES, key=lambda name: name != "cpu")
    groups = groups_for(settings.EXECUTOR)
    return render(request, "dashboard/run_new.html", {"recipes": recipes, "groups": groups, "devices": devices})


@login_required
def run_page(request: HttpRequest, run_id: int) -> HttpResponse:
    run = get_object_or_404(access.visible_runs(request.user).select_related("owner", "project"), pk=run_id)
    layout = run.spec.get("layout", {})
    run_page = {
        "id": run.pk,
        "status": run.status,
        "total_steps": run.total_steps,
        "layout": {dim: int(layout.get(dim, 1)) for dim in ("dp", "tp", "pp")},
        # A deployment's context defaults to what the model was trained on (its export's
        # max_position_embeddings); vLLM's own default may exceed it and be refused.
        "seq_len": int(run.spec.get("model", {}).get("seq_len", 0)) or None,
        "name": run.name,
        "keep_checkpoints": int(run.spec.get("train", {}).get("keep_checkpoints", 0)) or None,
        # A read-only member of the run's project sees no buttons that would answer 403.
        "can_change": access.can_change(request.user, run),
        # A LoRA run's checkpoint deploys merged into its base, or attaches to one of the
        # viewer's deployments of that base that serve adapters.
        "lora_rank": run.lora_rank,
        "attach_to": list(
            Deployment.objects.filter(
                owner_id=request.user.pk, pretrained_id=run.pretrained_id, status__in=Deployment.ACTIVE,
                options__max_loras__gte=1,
            ).values("id", "served_model_name")
        ) if run.lora_rank and run.pretrained_id else [],
    }
    mine = run.owner_id == request.user.pk
    # Its owner may move the run into a project they may write to, or out of one.
    projects = list(access.writable_projects(request.user).values("id", "name")) if mine else []
    return render(request, "dashboard/run.html", {"run": run, "run_page": run_page, "mine": mine, "projects": projects})


@login_required
def compare_page(request: HttpRequest) -> HttpResponse:
    """`/runs/compare/?ids=3,7,9[&all=1]`: the page reads `GET /api/runs/compare/` with the same
    query. A list of ids the API would refuse is shown here as its 400; a run not the caller's is a 404."""
    try:
        ids = compare.check_ids(request.GET.get("ids"))
    except InvalidInput as exc:
        return render(request, "dashboard/compare.html", {"error": exc.message, "ids": []}, status=400)
    visible = set(access.visible_runs(request.user).filter(pk__in=ids).values_list("pk", flat=True))
    if len(visible) != len(ids):
        raise Http404("No such run among yours.")
    return render(request, "dashboard/compare.html", {"error": "", "ids": ids})


@login_required
def deployment_page(request: HttpRequest, deployment_id: int) -> HttpResponse:
    deployment = get_object_or_404(
        Deployment.objects.select_related("checkpoint__run", "pretrained"), pk=deployment_id, owner=request.user
    )
    page = {"id": deployment.pk, "status": deployment.status, "model": deployment.served_model_name}
    adapters = list(deployment.adapters.select_related("checkpoint__run"))
    decisions = list(
        deployment.events.filter(kind__in=SCALING_EVENTS).order_by("-seq")[:SCALING_DECISIONS_SHOWN]
    )
    return render(
        request, "dashboard/deployment.html", {
            "deployment": deployment, "deployment_page": page, "adapters": adapters,
            "autoscaling": deployment.autoscaling_policy, "decisions": decisions,
        },
    )  # fmt: skip


@login_required
def webhooks_page(request: HttpRequest) -> HttpResponse:
    """The caller's webhooks with their recent deliveries, so a receiver that fails is noticed.
    Rendered here rather than by a module: the page only reads."""
    webhooks = list(Webhook.objects.filter(owner_id=request.user.pk))
    for webhook in webhooks:
        webhook.recent = list(webhook.deliveries.all()[:WEBHOOK_DELIVERIES_SHOWN])  # type: ignore[attr-defined]
    return render(request, "dashboard/webhooks.html", {"webhooks": webhooks})


@login_required
def projects_page(request: HttpRequest) -> HttpResponse:
    """The caller's projects with their members; its module changes them through the API."""
    projects = list(access.projects_of(request.user).select_related("owner").prefetch_related("members__user"))
    for project in projects:
        project.role = access.role_in(request.user, project)  # type: ignore[attr-defined]
    return render(request, "dashboard/projects.html", {"projects": projects, "roles": ProjectMember.Role.values})


@login_required
def deployments_page(request: HttpRequest) -> HttpResponse:
    return render(request, "dashboard/deployments.html")


@login_required
def sparklines(request: HttpRequest) -> JsonResponse:
    """`?runs=1,2,3` → `{"1": [[step, loss], …]}`: each run's loss curve thinned to a sparkline.

    The REST API's run list carries only the last loss; reading every run's event history in
    the browser to draw a 60-pixel line would move thousands of events per row.
    """
    try:
        ids = [int(part) for part in request.GET.get("runs", "").split(",") if part][:SPARKLINE_RUNS]
    except ValueError:
        return JsonResponse({"runs": ["must be a comma-separated list of run ids"]}, status=400)
    owned = list(access.visible_runs(request.user).filter(pk__in=ids).values_list("pk", flat=True))
    curves: dict[int, dict[int, float]] = {pk: {} for pk in owned}
    rows = (
        RunEvent.objects.filter(run_id__in=owned, kind="metrics")
        .order_by("seq")
        .values_list("run_id", "data__step", "data__loss")
    )
    for run_id, step, loss in rows:
        if isinstance(step, int) and isinstance(loss, (int, float)):
            curves[run_id][step] = loss  # a step repeated after a restart keeps its latest loss
    return JsonResponse({str(pk): _thin(sorted(curve.items())) for pk, curve in curves.items()})


def _thin(points: list[tuple[int, float]]) -> list[Any]:
    if len(points) <= SPARKLINE_POINTS:
        return [list(p) for p in points]
    stride = len(points) / SPARKLINE_POINTS
    picked = [points[int(i * stride)] for i in range(SPARKLINE_POINTS - 1)] + [points[-1]]
    return [list(p) for p in picked]
