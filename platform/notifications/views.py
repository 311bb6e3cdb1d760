from __future__ import annotations

from django.db.models import QuerySet
from drf_spectacular.utils import extend_schema
from rest_framework import viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api import owned
from notifications.models import Webhook
from notifications.serializers import DeliverySerializer, WebhookSerializer

# Deliveries a webhook's list shows: the recent ones, where a failure is noticed.
RECENT_DELIVERIES = 50


class WebhookViewSet(viewsets.ModelViewSet):
    """URLs that receive signed POSTs when the caller's runs finish, fail or restart and when
    their deployments become ready or fail. Another user's webhook answers 404. A deleted webhook
    receives nothing more, retries included."""

    serializer_class = WebhookSerializer
    http_method_names = ["get", "post", "patch", "delete", "head", "options"]

    def get_queryset(self) -> QuerySet[Webhook]:
        return owned(self, Webhook.objects.all())

    @extend_schema(responses=DeliverySerializer(many=True))
    @action(detail=True, methods=["get"], pagination_class=None)
    def deliveries(self, request: Request, pk: str) -> Response:
        """The webhook's most recent deliveries, newest first, with the receiver's last answer."""
        recent = self.get_object().deliveries.all()[:RECENT_DELIVERIES]
        return Response(DeliverySerializer(recent, many=True).data)
