from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.permissions import AllowAny
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from runs import logs, services
from runs.models import Checkpoint, Dataset, Run
from runs.serializers import (
    CheckpointSerializer,
    CloneSerializer,
    DatasetSerializer,
    IngestSerializer,
    RunEventSerializer,
    RunSerializer,
)

CHECKPOINT_ORDERING = OpenApiParameter(
    "ordering",
    str,
    enum=list(services.CHECKPOINT_ORDERINGS),
    description="Sort order; eval_loss puts the best held-out loss first (unevaluated checkpoints last).",
)


def _method(view: APIView) -> str | None:
    # The schema generator builds views without a request.
    return getattr(view.request, "method", None)


# The most events one history request returns; clients page on with ?after=<last seq>.
HISTORY_PAGE = 5000


def events_after_response(request: Request, events: QuerySet[Any], serializer: type[serializers.Serializer]) -> Response:
    """`?after=SEQ` history of a run's or a deployment's events, in order."""
    try:
        after = int(request.query_params.get("after", 0))
    except ValueError:
        return Response({"after": ["must be an integer"]}, status=400)
    page = events.filter(seq__gt=after).order_by("seq")[:HISTORY_PAGE]
    return Response(serializer(page, many=True).data)


def owned(view: Any, queryset: QuerySet[Any], owner_field: str = "owner") -> QuerySet[Any]:
    """The caller's own objects; no objects while the schema generator inspects the view."""
    if getattr(view, "swagger_fake_view", False):
        return queryset.none()
    return queryset.filter(**{owner_field: view.request.user})


class DatasetViewSet(
    mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    serializer_class = DatasetSerializer
    # A file arrives as a multipart upload; an administrator's server path as JSON.
    parser_classes = [MultiPartParser, JSONParser]

    def get_queryset(self) -> QuerySet[Dataset]:
        return owned(self, Dataset.objects.all())


class RunViewSet(mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Training runs. Another user's run answers 404, as if it did not exist."""

    serializer_class = RunSerializer
    conflict_actions = ("cancel", "resume")  # a run already past the state they start from answers 409

    def get_queryset(self) -> QuerySet[Run]:
        runs = owned(self, Run.objects.all())
        if status_filter := self.request.query_params.get("status"):
            runs = runs.filter(status__in=status_filter.split(","))
        return runs

    def _change(self, request: Request, operation: Callable[[Run], Run]) -> Response:
        run = operation(self.get_object())
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
        body: dict[str, Any] = {
            "name": edits.get("name") or f"{source.name} (clone)",
            "dataset": edits.get("dataset", source.dataset_id),
            "tokenizer_run": edits.get("tokenizer_run", source.tokenizer_run_id),
            "validation_dataset": edits.get("validation_dataset", source.validation_dataset_id),
            "spec": services.deep_merge(spec, edits.get("spec") or {}),
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
        services.check_run_data(
            checked["run_spec"], checked.get("dataset"), checked.get("tokenizer_run"), checked.get("validation_dataset")
        )
        services.check_fits_cluster(checked["run_spec"])
        services.check_run_storage()
        return Response({"spec": checked["run_spec"].to_dict()})

    # A run keeps a handful of checkpoints (train.keep_checkpoints prunes the rest), so they come
    # as one list, not in pages.
    @extend_schema(parameters=[CHECKPOINT_ORDERING], responses=CheckpointSerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def checkpoints(self, request: Request, pk: str) -> Response:
        run = self.get_object()
        ordered = services.order_checkpoints(run.checkpoints.all(), request.query_params.get("ordering"))
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
        run = get_object_or_404(Run, pk=run_id, owner=request.user)
        return events_after_response(request, run.events.all(), RunEventSerializer)

    @extend_schema(
        request=IngestSerializer,
        responses={
            200: inline_serializer("IngestAck", {"last_seq": serializers.IntegerField()}),
            401: inline_serializer("RunTokenRequired", {"detail": serializers.CharField()}),
        },
    )
    def post(self, request: Request, run_id: int) -> Response:
        run = Run.objects.filter(pk=run_id).first()
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        if run is None or not token or not run.token_hash or not hmac.compare_digest(
            services.hash_token(token), run.token_hash
        ):
            return Response({"detail": "A valid run token is required."}, status=status.HTTP_401_UNAUTHORIZED)
        # IngestSerializer documents the body; plain checks validate it (services.check_ingest_batch says why).
        source, events = services.check_ingest_batch(request.data)
        return Response({"last_seq": services.do_ingest_events(run, source, events)})


@extend_schema_view(list=extend_schema(parameters=[CHECKPOINT_ORDERING]))
class CheckpointViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = CheckpointSerializer

    def get_queryset(self) -> QuerySet[Checkpoint]:
        checkpoints = owned(self, Checkpoint.objects.select_related("run"), "run__owner")
        if self.action == "list":
            return services.order_checkpoints(checkpoints, self.request.query_params.get("ordering"))
        return checkpoints
