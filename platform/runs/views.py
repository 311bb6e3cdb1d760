from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, PermissionDenied
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import events_after_response, owned
from controlplane.exceptions import InvalidInput
from controlplane.shipped_pieces import ShippedPieceView
from hosts.models import DeviceClaim
from launch import run_agents
from runs import access, compare, goodput, logs, organise, services, specs
from runs.models import Checkpoint, Dataset, PretrainedModel, Project, Run
from runs.serializers import (
    CheckpointSerializer,
    CloneSerializer,
    CompareQuerySerializer,
    ComparisonSerializer,
    DatasetPathSerializer,
    DatasetSerializer,
    GoodputSerializer,
    IngestSerializer,
    MemberSerializer,
    OrganiseSerializer,
    PretrainedModelPathSerializer,
    PretrainedModelSerializer,
    ProjectSerializer,
    RunEventSerializer,
    RunSerializer,
    ShippedLogSerializer,
)
from training.config import RECIPES

CHECKPOINT_ORDERING = OpenApiParameter(
    "ordering",
    str,
    enum=list(services.CHECKPOINT_ORDERINGS),
    description="Sort order; eval_loss puts the best held-out loss first (unevaluated checkpoints last).",
)


def _method(view: APIView) -> str | None:
    # The schema generator builds views without a request.
    return getattr(view.request, "method", None)


@extend_schema_view(
    create=extend_schema(
        request={"multipart/form-data": DatasetSerializer, "application/json": DatasetPathSerializer},
        responses={201: DatasetSerializer},
    )
)
class DatasetViewSet(
    mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = DatasetSerializer
    # A file arrives as a multipart upload; an administrator's server path as JSON.
    parser_classes = [MultiPartParser, JSONParser]

    def get_queryset(self) -> QuerySet[Dataset]:
        return owned(self, Dataset.objects.all())


@extend_schema_view(
    create=extend_schema(
        request={"multipart/form-data": PretrainedModelSerializer, "application/json": PretrainedModelPathSerializer},
        responses={201: PretrainedModelSerializer},
    )
)
class PretrainedModelViewSet(
    mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Hugging Face Llama folders runs may start from, each its owner's, like datasets."""

    serializer_class = PretrainedModelSerializer
    # The folder's files arrive as one multipart upload; an administrator's server folder as JSON.
    parser_classes = [MultiPartParser, JSONParser]

    def get_queryset(self) -> QuerySet[PretrainedModel]:
        return owned(self, PretrainedModel.objects.all())


RUN_FILTERS = [
    OpenApiParameter("search", str, description="Runs whose name or note contains this text (any case)."),
    OpenApiParameter(
        "tag",
        {"type": "array", "items": {"type": "string", "pattern": organise.TAG_FILTER_PATTERN}},
        description="Runs that carry every one of these tags (repeat it, or separate with commas).",
    ),
    OpenApiParameter(
        "status",
        {"type": "string", "pattern": organise.STATUS_FILTER_PATTERN},
        description=f"Comma-separated statuses, any of: {', '.join(Run.Status.values)}.",
    ),
    # Empty means any recipe, as the dashboard's filter form sends it (schemathesis found the
    # schema saying otherwise).
    OpenApiParameter("recipe", str, enum=["", *RECIPES], description="Runs launched from this recipe (empty: any)."),
    OpenApiParameter("project", int, description="Runs in this project (its id)."),
    OpenApiParameter("layout", str, description=f"Runs with this layout: {organise.LAYOUT_RULE}."),
]


@extend_schema_view(list=extend_schema(parameters=RUN_FILTERS))
class RunViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Training runs. Another user's run answers 404, as if it did not exist."""

    serializer_class = RunSerializer
    conflict_actions = ("cancel", "resume")  # a run already past the state they start from answers 409

    def get_queryset(self) -> QuerySet[Run]:
        if getattr(self, "swagger_fake_view", False):
            return Run.objects.none()
        # The caller's runs and their projects' runs; a change also needs access.check_can_change.
        runs = access.visible_runs(self.request.user, Run.objects.select_related("owner").prefetch_related("tags"))
        if self.action == "list":
            runs = organise.filter_runs(runs, self.request.query_params)
        return runs

    @extend_schema(request=OrganiseSerializer, responses=RunSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        """Changes the run's tags, note and project (what is left out stays). Read-only members of
        its project get 403; only the run's owner moves it between projects."""
        run = self.get_object()
        access.check_can_change(request.user, run)
        body = OrganiseSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        changes = body.validated_data
        project = None
        if "project" in changes:
            if changes["project"] is not None:
                project = access.projects_of(request.user).filter(pk=changes["project"]).first()
                if project is None:
                    raise InvalidInput("project", f"you have no project {changes['project']}")
            access.check_project_for(request.user, project, run)
        organise.do_organise_run(run, tags=changes.get("tags"), note=changes.get("note"))
        if "project" in changes:
            organise.do_move_run(run, project)
        run = self.get_queryset().get(pk=run.pk)
        return Response(RunSerializer(run, context={"request": request}).data)

    @extend_schema(
        parameters=[CompareQuerySerializer],
        responses={200: ComparisonSerializer, 404: inline_serializer("RunsNotFound", {"detail": serializers.CharField()})},
    )
    @action(detail=False, methods=["get"], pagination_class=None)
    def compare(self, request: Request) -> Response:
        """Per-step loss, eval loss, tokens/s and MFU of 2 to 8 of your runs, their final and best
        figures, and the spec fields whose values differ (`?all=1`: every field). Any id that is
        not one of your runs answers 404."""
        ids = compare.check_ids(request.query_params.get("ids"))
        query = {"ids": ",".join(map(str, ids)), "all": request.query_params.get("all", False)}
        show_all = CompareQuerySerializer(data=query)
        show_all.is_valid(raise_exception=True)
        found = {run.pk: run for run in self.get_queryset().filter(pk__in=ids)}
        missing = [pk for pk in ids if pk not in found]
        if missing:
            raise NotFound(f"No run {missing[0]} among yours.")
        return Response(compare.comparison([found[pk] for pk in ids], show_all.validated_data["all"]))

    def _change(self, request: Request, operation: Callable[[Run], Run]) -> Response:
        run = self.get_object()
        access.check_can_change(request.user, run)
        run = operation(run)
        return Response(RunSerializer(run, context={"request": request}).data)

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str) -> Response:
        return self._change(request, services.do_cancel_run)

    @extend_schema(request=None, responses=RunSerializer)
    @action(detail=True, methods=["post"])
    def resume(self, request: Request, pk: str) -> Response:
        return self._change(request, services.do_resume_run)

    @extend_schema(request=CloneSerializer, responses={201: RunSerializer})
    @action(detail=True, methods=["post"])
    def clone(self, request: Request, pk: str) -> Response:
        """A new run from this one's spec, with the edits in the body merged over it."""
        source = self.get_object()
        body_check = CloneSerializer(data=request.data)
        body_check.is_valid(raise_exception=True)
        edits: dict[str, Any] = body_check.validated_data
        # The source's data section holds the paths resolved from its objects at submit; the clone
        # names its data through the same objects (or the edits' own), never through a stored path.
        spec = {section: values for section, values in source.spec.items() if section != "data"}
        # The one data setting that is not a path: the share held out for evaluation.
        spec["data"] = {"validation_fraction": source.spec.get("data", {}).get("validation_fraction", 0.0)}
        if edits.get("pretrained", source.pretrained_id) is not None:
            # The model comes from the pretrained folder again; the training context stays the run's.
            spec["model"] = {"seq_len": source.spec.get("model", {}).get("seq_len")}
        body: dict[str, Any] = {
            "name": edits.get("name") or f"{source.name} (clone)",
            "dataset": edits.get("dataset", source.dataset_id),
            "tokenizer_run": edits.get("tokenizer_run", source.tokenizer_run_id),
            "validation_dataset": edits.get("validation_dataset", source.validation_dataset_id),
            "pretrained": edits.get("pretrained", source.pretrained_id),
            "recipe": source.recipe or "tiny",
            "spec": specs.deep_merge(spec, edits.get("spec") or {}),
        }
        if source.slurm and settings.EXECUTOR == "slurm":
            body["slurm"] = source.slurm  # its Slurm options, resolved: checked again against the cluster
        serializer = RunSerializer(data=body, context={"request": request})
        serializer.is_valid(raise_exception=True)
        run = serializer.save()
        return Response(RunSerializer(run, context={"request": request}).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        request=RunSerializer,
        responses={
            200: inline_serializer("CheckedSpec", {"spec": serializers.DictField()}),
        },
    )
    @action(detail=False, methods=["post"])
    def check(self, request: Request) -> Response:
        """Validates a run body as launching it would, without launching: the resolved spec, or
        the same 400 naming each field. The launch form's layout check starts here."""
        serializer = RunSerializer(data=request.data, context={"request": request})
        serializer.is_valid(raise_exception=True)
        checked = serializer.validated_data
        specs.check_run_data(
            checked["run_spec"], checked.get("dataset"), checked.get("tokenizer_run"), checked.get("validation_dataset"),
            checked.get("pretrained"),
        )  # fmt: skip
        services.check_fits_cluster(checked["run_spec"])
        specs.check_run_storage()
        return Response({"spec": checked["run_spec"].to_dict()})

    # A run keeps a handful of checkpoints (train.keep_checkpoints prunes the rest), so they come
    # as one list, not in pages.
    @extend_schema(parameters=[CHECKPOINT_ORDERING], responses=CheckpointSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def checkpoints(self, request: Request, pk: str) -> Response:
        run = self.get_object()
        ordered = services.order_checkpoints(run.checkpoints.prefetch_related("quantized_exports"), request.query_params.get("ordering"))
        return Response(CheckpointSerializer(ordered, many=True).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("rank", int, description="Rank whose log to read (default 0)."),
            OpenApiParameter("lines", int, description="Lines from the end (default 200, at most 5000)."),
        ],
        responses=inline_serializer("LogTail", {"rank": serializers.IntegerField(), "lines": serializers.ListField()}),
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str) -> Response:
        run = self.get_object()
        try:
            rank = int(request.query_params.get("rank", 0))
            count = min(int(request.query_params.get("lines", 200)), 5000)
        except ValueError:
            return Response({"rank": ["must be an integer"]}, status=400)
        return Response({"rank": rank, "lines": logs.tail(run, rank, count)})


class RunEventsView(APIView):
    """GET: a run's history for its owner (`?after=SEQ`). POST: a node agent's batch (run token)."""

    def get_permissions(self) -> list[Any]:
        return [AllowAny()] if _method(self) == "POST" else list(super().get_permissions())

    def get_authenticators(self) -> list[Any]:
        # Agents authenticate with their run's bearer token, checked in post(); no session/CSRF.
        return [] if _method(self) == "POST" else super().get_authenticators()

    @extend_schema(
        parameters=[OpenApiParameter("after", int, description="Only events with a larger seq.")],
        responses=RunEventSerializer(many=True),
    )
    def get(self, request: Request, run_id: int) -> Response:
        run = get_object_or_404(access.visible_runs(request.user), pk=run_id)
        return events_after_response(request, run.events.all(), RunEventSerializer)

    @extend_schema(
        request=IngestSerializer,
        responses={
            200: inline_serializer("IngestAck", {"last_seq": serializers.IntegerField()}),
            401: inline_serializer("RunTokenRequired", {"detail": serializers.CharField()}),
        },
    )
    def post(self, request: Request, run_id: int) -> Response:
        run = _run_of_token(request, run_id, services.check_source(request.data))
        if run is None:
            return Response({"detail": NODE_TOKEN_REQUIRED.format(what='"source"')}, status=status.HTTP_401_UNAUTHORIZED)
        # IngestSerializer documents the body; plain checks validate it (services.check_ingest_batch says why).
        source, events = services.check_ingest_batch(request.data)
        return Response({"last_seq": services.do_ingest_events(run, source, events)})


class RunGoodputView(APIView):
    """GET: where the run's wall time went, from its events (runs/goodput.py; docs/training.md)."""

    @extend_schema(responses=GoodputSerializer)
    def get(self, request: Request, run_id: int) -> Response:
        run = get_object_or_404(access.visible_runs(request.user), pk=run_id)
        return Response(goodput.ledger_of(run.events.order_by("seq").values_list("kind", "time", "data")).as_dict())


NODE_TOKEN_REQUIRED = "The bearer token of the node that {what} names, in the run's current launch, is required."


def _run_of_token(request: Request, run_id: int, node: int | None) -> Run | None:
    """The run if the request's bearer token is node `node`'s in its current launch; else None."""
    run = Run.objects.filter(pk=run_id).first()
    auth = request.headers.get("Authorization", "")
    token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
    if run is None or node is None or not run_agents.is_node_token(run, node, token):
        return None
    return run


@extend_schema_view(post=extend_schema(
    request=ShippedLogSerializer,
    responses={
        200: inline_serializer(
            "ShippedLogAck",
            {"offset": serializers.IntegerField(required=False), "shared": serializers.BooleanField(required=False)},
        ),
        401: inline_serializer("ShippedLogRunTokenRequired", {"detail": serializers.CharField()}),
        403: inline_serializer("ShippedLogNotFromItsHost", {"detail": serializers.CharField()}),
    },
))
class ShippedLogsView(ShippedPieceView):
    """POST: a piece of a log of a host's run folder (the node's token), kept in ours for the log
    API (`training.agent.log_shipper` says what is shipped)."""

    body = ShippedLogSerializer
    max_piece_bytes = logs.MAX_PIECE_BYTES
    token_required = NODE_TOKEN_REQUIRED.format(what='"node"')

    def sender(self, request: Request, **url: Any) -> Run | None:
        node = request.data.get("node") if isinstance(request.data, dict) else None
        return _run_of_token(request, url["run_id"], node if type(node) is int and node >= 0 else None)

    def accept(self, run: Run, piece: dict[str, Any]) -> bool:
        # A node's logs are kept under its host's address: while the node holds devices, that
        # is the address of the host they are on, not one the sender names.
        placed = DeviceClaim.objects.filter(run=run, node=piece["node"]).select_related("host").first()
        if placed is not None and piece["address"] != placed.host.address:
            raise PermissionDenied(f"address: node {piece['node']} runs on {placed.host.address}; got {piece['address']!r}")
        return logs.shared_with_agent(run, piece["node"], piece["probe"])

    def append(self, run: Run, piece: dict[str, Any], data: bytes) -> int:
        return logs.append_shipped(run, piece["address"], piece["file"], piece["offset"], data)


@extend_schema_view(list=extend_schema(parameters=[CHECKPOINT_ORDERING]))
class CheckpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = CheckpointSerializer

    def get_queryset(self) -> QuerySet[Checkpoint]:
        if getattr(self, "swagger_fake_view", False):
            return Checkpoint.objects.none()
        checkpoints = access.visible_checkpoints(self.request.user).select_related("run").prefetch_related("quantized_exports")
        if self.action == "list":
            return services.order_checkpoints(checkpoints, self.request.query_params.get("ordering"))
        return checkpoints


class ProjectViewSet(
    mixins.CreateModelMixin,
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.DestroyModelMixin,
    viewsets.GenericViewSet,
):
    """Projects the caller owns or is a member of; any other answers 404. Only the owner renames
    or deletes a project (its runs then belong to no project) and changes its members (403 for a
    member)."""

    serializer_class = ProjectSerializer

    def get_queryset(self) -> QuerySet[Project]:
        if getattr(self, "swagger_fake_view", False):
            return Project.objects.none()
        return access.projects_of(self.request.user).select_related("owner")

    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        serializer.save(owner=self.request.user)

    def perform_destroy(self, instance: Project) -> None:
        access.check_project_owner(self.request.user, instance)
        instance.delete()

    @extend_schema(request=ProjectSerializer, responses=ProjectSerializer)
    def partial_update(self, request: Request, pk: str) -> Response:
        project = self.get_object()
        access.check_project_owner(request.user, project)
        serializer = ProjectSerializer(project, data=request.data, partial=True, context={"request": request})
        serializer.is_valid(raise_exception=True)
        serializer.save()
        return Response(serializer.data)

    @extend_schema(request=MemberSerializer, responses=ProjectSerializer)
    @action(detail=True, methods=["post"])
    def members(self, request: Request, pk: str) -> Response:
        """Adds a member by username, or changes their role (read or write)."""
        project = self.get_object()
        access.check_project_owner(request.user, project)
        body = MemberSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        access.do_set_member(project, body.validated_data["username"], body.validated_data["role"])
        return Response(ProjectSerializer(project, context={"request": request}).data)

    @extend_schema(request=None, responses=ProjectSerializer)
    @action(detail=True, methods=["delete"], url_path=r"members/(?P<username>[^/]+)")
    def remove_member(self, request: Request, pk: str, username: str) -> Response:
        """Removes a member; they no longer see the project's runs. 404 if they were not one."""
        project = self.get_object()
        access.check_project_owner(request.user, project)
        if not access.do_remove_member(project, username):
            raise NotFound(f"{username!r} is not a member of this project.")
        return Response(ProjectSerializer(project, context={"request": request}).data)
