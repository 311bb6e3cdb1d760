from __future__ import annotations

import hmac
import logging
from typing import Any

from django.conf import settings
from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.permissions import AllowAny, IsAdminUser
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from hosts import quotas, scheduling, services
from hosts.models import Host, Quota
from hosts.serializers import (
    HeartbeatSerializer,
    HostSerializer,
    MyQuotaSerializer,
    QueueEntrySerializer,
    QuotaSerializer,
)
from runs import access

log = logging.getLogger(__name__)


class HostViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """The cluster's hosts, for every signed-in user; draining, undraining and removing are for staff."""

    serializer_class = HostSerializer
    queryset = Host.objects.prefetch_related("claims")
    conflict_actions = ("drain", "undrain", "remove")

    def get_permissions(self) -> list[Any]:
        if self.action in self.conflict_actions:
            return [IsAdminUser()]
        return list(super().get_permissions())

    @extend_schema(request=None, responses={204: None})
    @action(detail=True, methods=["post"])
    def remove(self, request: Request, pk: str) -> Response:
        """Forgets a host that holds no device (its secret with it): a machine can join under its name again."""
        services.do_remove(self.get_object())
        return Response(status=status.HTTP_204_NO_CONTENT)

    @extend_schema(request=None, responses=HostSerializer)
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: str) -> Response:
        return Response(HostSerializer(services.do_drain(self.get_object())).data)

    @extend_schema(request=None, responses=HostSerializer)
    @action(detail=True, methods=["post"])
    def undrain(self, request: Request, pk: str) -> Response:
        return Response(HostSerializer(services.do_undrain(self.get_object())).data)

    def get_queryset(self) -> QuerySet[Host]:
        return Host.objects.prefetch_related("claims")


class HeartbeatView(APIView):
    """A host worker's heartbeat, with the secret its host was given as bearer; its first one (its
    join) carries the cluster's join token instead, and its answer gives the host its secret."""

    permission_classes = [AllowAny]
    authentication_classes: list[Any] = []  # the join token is checked in post(); no session or CSRF

    @extend_schema(
        request=HeartbeatSerializer,
        responses={
            200: inline_serializer(
                "HeartbeatAck",
                {"status": serializers.CharField(), "host_secret": serializers.CharField(required=False)},
            ),
            401: inline_serializer("JoinTokenRequired", {"detail": serializers.CharField()}),
            403: inline_serializer("HostNameTaken", {"detail": serializers.CharField()}),
        },
    )
    def post(self, request: Request) -> Response:
        auth = request.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else ""
        peer = request.META.get("REMOTE_ADDR", "?")
        if not settings.JOIN_TOKEN:
            log.warning("host heartbeat from %s refused: FATHOM_JOIN_TOKEN is not set, so no host may join", peer)
            return Response(
                {"detail": "This control plane takes no hosts: FATHOM_JOIN_TOKEN is not set."},
                status=status.HTTP_401_UNAUTHORIZED,
            )
        if not token:
            log.warning("host heartbeat from %s refused: no join token or host secret", peer)
            return Response({"detail": "A valid join token is required."}, status=status.HTTP_401_UNAUTHORIZED)
        body = HeartbeatSerializer(data=request.data)
        body.is_valid(raise_exception=True)
        name = body.validated_data["name"]
        if services.is_hosts_secret(name, token):
            host = services.do_heartbeat(**body.validated_data)
            services.do_stop_orphans(host)
            return Response({"status": host.status})
        if not hmac.compare_digest(token.encode(), settings.JOIN_TOKEN.encode()):
            log.warning("host heartbeat from %s for host %s refused: neither its secret nor the join token", peer, name)
            return Response(
                {"detail": f"A valid join token, or the secret host {name} was given when it joined, is required."},
                status=status.HTTP_401_UNAUTHORIZED,
            )
        try:
            host, secret = services.do_join(**body.validated_data)
        except services.NameTaken:
            log.warning("join from %s as host %s refused: that host has its own secret", peer, name)
            return Response(
                {
                    "detail": f"Host {name} has joined already and beats with its own secret; the join token "
                    "cannot speak for it. Staff remove it on /hosts before a machine joins under that name again."
                },
                status=status.HTTP_403_FORBIDDEN,
            )
        services.do_stop_orphans(host)
        return Response({"status": host.status, "host_secret": secret})


class QuotaViewSet(viewsets.ModelViewSet):
    """Quotas of users and projects: staff set them (`hosts/quotas.py` says what each limit does)."""

    serializer_class = QuotaSerializer
    queryset = Quota.objects.select_related("user", "project")
    permission_classes = [IsAdminUser]


class MyQuotaView(APIView):
    """What you may submit and hold on the cluster, and what your runs (and your projects' runs) hold now."""

    @extend_schema(responses=MyQuotaSerializer)
    def get(self, request: Request) -> Response:
        return Response(MyQuotaSerializer(quotas.quota_of(request.user, access.projects_of(request.user))).data)


class QueueView(APIView):
    """The queue in the order the scheduler offers it room, why each run waits, and the head's
    reservation. Every queued run is listed (its position is everyone's business); the names of
    runs you may not see are left out."""

    @extend_schema(responses=QueueEntrySerializer(many=True))
    def get(self, request: Request) -> Response:
        entries = scheduling.queue_order()
        visible = set(access.visible_runs(request.user).filter(status="queued").values_list("pk", flat=True))
        head = scheduling.queue_head()
        rows = [
            {
                "position": e["position"], "id": e["run"].pk, "name": e["run"].name if e["run"].pk in visible else None,
                "owner": e["run"].owner.username, "project": e["run"].project_id, "priority": e["run"].priority,
                "share": e["share"], "share_recent_slots": e["share_recent_slots"], "needs": e["needs"],
                "status_reason": scheduling.shown_reason(e["run"].status, e["run"].status_reason, head),
                "reservation": e["run"].reservation, "created_at": e["run"].created_at,
            }
            for e in entries
        ]  # fmt: skip
        return Response(QueueEntrySerializer(rows, many=True).data)
