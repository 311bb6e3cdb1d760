from __future__ import annotations

from typing import Any

from django.db.models import QuerySet
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_view, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.generics import get_object_or_404
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api import events_after_response, owned
from controlplane.exceptions import WrongState
from controlplane.shipped_pieces import ShippedPieceView
from deployments import services, shipped
from deployments.models import Adapter, ApiKey, Deployment
from deployments.serializers import (
    AdapterSerializer,
    ApiKeySerializer,
    AutoscalingSerializer,
    DeploymentEventSerializer,
    DeploymentSerializer,
    NewApiKeySerializer,
    ShippedPieceSerializer,
)

# Lines of a replica's log the start-up panel shows: the last screenful of vLLM's progress.
LOG_LINES_DEFAULT = 40
LOG_LINES_MAX = 2000

DEPLOYMENT_ID = OpenApiParameter("deployment_id", int, OpenApiParameter.PATH, description="The deployment's id.")


class ReplicaLogQuery(serializers.Serializer):
    replica = serializers.IntegerField(min_value=0, default=0, help_text="Replica index (default 0).")
    lines = serializers.IntegerField(
        min_value=1, max_value=LOG_LINES_MAX, default=LOG_LINES_DEFAULT, help_text="Lines from the end."
    )


class DeploymentViewSet(
    mixins.CreateModelMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet
):
    """Checkpoints (or pretrained models, with LoRA adapters attached) served by vLLM replicas.
    Another user's deployment answers 404."""

    serializer_class = DeploymentSerializer
    conflict_actions = ("stop", "autoscaling")  # a deployment already stopped or failed answers 409

    def get_queryset(self) -> QuerySet[Deployment]:
        return owned(self, Deployment.objects.prefetch_related("replica_set", "adapters"))

    def perform_create(self, serializer: Any) -> None:
        data = serializer.validated_data
        serializer.instance = services.do_create_deployment(
            self.request.user,
            data.get("checkpoint"),
            pretrained=data.get("pretrained"),
            merged=data["merged"],
            routing=data["routing"],
            autoscaling=data.get("autoscaling"),
            name=data.get("name", ""),
            served_model_name=data.get("served_model_name", ""),
            replicas=data["replicas"],
            options=data["options"],
            quantization=data["quantization"],
        )

    @extend_schema(request=None, responses=DeploymentSerializer)
    @action(detail=True, methods=["post"])
    def stop(self, request: Request, pk: str) -> Response:
        deployment = services.do_stop_deployment(self.get_object())
        return Response(DeploymentSerializer(deployment, context={"request": request}).data)

    @extend_schema(request=AutoscalingSerializer, responses=DeploymentSerializer)
    @action(detail=True, methods=["put"])
    def autoscaling(self, request: Request, pk: str) -> Response:
        """Replace the deployment's autoscaling policy (null: keep the replicas it runs now)."""
        body = AutoscalingSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        deployment = services.do_set_autoscaling(self.get_object(), body.validated_data["autoscaling"])
        return Response(DeploymentSerializer(deployment, context={"request": request}).data)

    @extend_schema(
        parameters=[OpenApiParameter("after", int, description="Only events with a larger seq.")],
        responses=DeploymentEventSerializer(many=True),
    )
    @action(detail=True, methods=["get"], pagination_class=None)  # pages with ?after=, as a run's events do
    def events(self, request: Request, pk: str) -> Response:
        return events_after_response(request, self.get_object().events.all(), DeploymentEventSerializer)

    @extend_schema(
        parameters=[ReplicaLogQuery],
        responses=inline_serializer(
            "ReplicaLogTail",
            {"replica": serializers.IntegerField(), "lines": serializers.ListField(child=serializers.CharField())},
        ),
    )
    @action(detail=True, methods=["get"])
    def logs(self, request: Request, pk: str) -> Response:
        """The end of a replica's log (vLLM's own output): what a starting replica is doing."""
        deployment = self.get_object()
        query = ReplicaLogQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        replica, lines = query.validated_data["replica"], query.validated_data["lines"]
        return Response({"replica": replica, "lines": services.log_tail(deployment, replica, lines)})


@extend_schema_view(
    list=extend_schema(parameters=[DEPLOYMENT_ID]),
    create=extend_schema(parameters=[DEPLOYMENT_ID], responses={201: NewApiKeySerializer}),
    retrieve=extend_schema(parameters=[DEPLOYMENT_ID]),
    partial_update=extend_schema(parameters=[DEPLOYMENT_ID]),
    revoke=extend_schema(parameters=[DEPLOYMENT_ID], request=None, responses=ApiKeySerializer),
)
class ApiKeyViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """A deployment's API keys for its /v1 endpoint, newest first: each with its record of use
    and its rate limit. Revoked keys stay listed. Another user's deployment answers 404."""

    serializer_class = ApiKeySerializer
    # A revoked key cannot be changed or revoked again, and a deployment that stopped takes no
    # new keys: 409.
    conflict_actions = ("create", "partial_update", "revoke")

    def deployment(self) -> Deployment:
        return get_object_or_404(owned(self, Deployment.objects.all()), pk=self.kwargs["deployment_id"])

    def get_queryset(self) -> QuerySet[ApiKey]:
        if getattr(self, "swagger_fake_view", False):
            return ApiKey.objects.none()
        return self.deployment().api_keys.all()

    def create(self, request: Request, deployment_id: str) -> Response:
        """Creates a key; the answer holds its secret, which is never shown again."""
        body = ApiKeySerializer(data=request.data)
        body.is_valid(raise_exception=True)
        key, raw = services.do_issue_key(self.deployment(), **body.validated_data)
        return Response({**ApiKeySerializer(key).data, "key": raw}, status=status.HTTP_201_CREATED)

    def partial_update(self, request: Request, deployment_id: str, pk: str) -> Response:
        """Renames a key or changes its rate limit; every web process applies a new limit within
        the key cache's 5 s."""
        key = self.get_object()
        body = ApiKeySerializer(key, data=request.data, partial=True)
        body.is_valid(raise_exception=True)
        key = services.do_change_key(key, **body.validated_data)
        return Response(ApiKeySerializer(key).data)

    @action(detail=True, methods=["post"])
    def revoke(self, request: Request, deployment_id: str, pk: str) -> Response:
        """Revokes a key: /v1 refuses it (401) in every web process within the key cache's 5 s.
        The key stays listed with its record of use."""
        key = services.do_revoke_key(self.get_object())
        return Response(ApiKeySerializer(key).data)


@extend_schema_view(
    list=extend_schema(parameters=[DEPLOYMENT_ID]),
    create=extend_schema(parameters=[DEPLOYMENT_ID]),
    retrieve=extend_schema(parameters=[DEPLOYMENT_ID]),
    destroy=extend_schema(parameters=[DEPLOYMENT_ID]),
)
class AdapterViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    """LoRA adapters a deployment of their base serves, each under a model name of its own on
    the same replicas (attached or detached without restarting them). /v1 serves an adapter
    with the deployment's keys once its replicas have loaded it, and /v1/models lists it with
    the base as its `parent`. Another user's deployment answers 404."""

    serializer_class = AdapterSerializer
    conflict_actions = ("create",)  # a deployment that stopped takes no adapter: 409

    def deployment(self) -> Deployment:
        return get_object_or_404(owned(self, Deployment.objects.all()), pk=self.kwargs["deployment_id"])

    def get_queryset(self) -> QuerySet[Adapter]:
        if getattr(self, "swagger_fake_view", False):
            return Adapter.objects.none()
        return self.deployment().adapters.all()

    def create(self, request: Request, deployment_id: str) -> Response:
        """Attaches a LoRA run's checkpoint; each refusal names the field (a full fine-tune's
        checkpoint, another base, a rank over options.max_lora_rank, a name in use)."""
        body = AdapterSerializer(data=request.data, context={"request": request})
        body.is_valid(raise_exception=True)
        adapter = services.do_attach_adapter(self.deployment(), body.validated_data["checkpoint"], body.validated_data.get("name", ""))
        return Response(AdapterSerializer(adapter).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance: Adapter) -> None:
        """Detaches it: its name answers 404 once the replicas have unloaded it."""
        services.do_detach_adapter(instance)


@extend_schema_view(post=extend_schema(
    request=ShippedPieceSerializer,
    responses={
        200: inline_serializer(
            "ShippedPieceAck",
            {"offset": serializers.IntegerField(required=False), "shared": serializers.BooleanField(required=False)},
        ),
        401: inline_serializer("ShippedPieceTokenRequired", {"detail": serializers.CharField()}),
        409: inline_serializer("ShippedPieceHostHoldsNothing", {"host": serializers.ListField(child=serializers.CharField())}),
    },
))
class ShippedFolderView(ShippedPieceView):
    """POST: a piece of a host's supervisor folder (the deployment's supervisor token for that
    host; refused while the deployment holds no device there), kept in our copy that sync, the
    routers and the log API read (`serving.shipper` says what is shipped)."""

    body = ShippedPieceSerializer
    max_piece_bytes = shipped.MAX_PIECE_BYTES
    token_required = "A valid supervisor token for the host named in `host` is required."

    def sender(self, request: Request, **url: Any) -> Deployment | None:
        host = request.data.get("host") if isinstance(request.data, dict) else None
        return shipped.deployment_of_token(url["deployment_id"], str(host), request.headers.get("Authorization", ""))

    def accept(self, deployment: Deployment, piece: dict[str, Any]) -> bool:
        if shipped.shared_with_supervisor(shipped.copy_of(deployment, piece["host"]), piece["probe"]):
            return True
        if not shipped.holds_devices(deployment, piece["host"]):
            raise WrongState(
                "host",
                f"host {piece['host']} holds no device of deployment {deployment.pk} now (the host was lost, "
                "or the deployment ended there): what runs there of it is being stopped, and sends nothing",
            )
        return False

    def append(self, deployment: Deployment, piece: dict[str, Any], data: bytes) -> int:
        return shipped.receive(shipped.copy_of(deployment, piece["host"]), piece["file"], piece["offset"], data)
