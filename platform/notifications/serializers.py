from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api import ModelSerializer
from notifications import services
from notifications.events import EVENTS
from notifications.models import Delivery, Webhook


class WebhookSerializer(ModelSerializer):
    """A webhook. Its secret is write-only: it is never shown again after it is set."""

    events = serializers.ListField(
        child=serializers.ChoiceField(choices=EVENTS),
        min_length=1,
        required=False,
        help_text="The events it hears (at least one); all of them when a new webhook names none.",
    )

    class Meta:
        model = Webhook
        fields = ["id", "url", "secret", "events", "created_at"]
        read_only_fields = ["id", "created_at"]
        extra_kwargs = {
            "secret": {"write_only": True, "min_length": 16},
            # Which addresses a URL may reach depends on where its name resolves and on
            # FATHOM_WEBHOOK_ALLOW_NETWORKS (controlplane/outbound.py): the schema can only say so.
            # (A pattern for the scheme made schemathesis' generator stall with maxLength 1000.)
            "url": {
                "help_text": (
                    "http:// or https:// URL that receives the events. Refused (400) when its host is, "
                    "or resolves to, a loopback, private, link-local or other internal address, or is "
                    "this server's own host name."
                ),
            },
        }

    def validate_url(self, url: str) -> str:
        try:
            return services.check_url(url)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def validate_events(self, events: list[str]) -> list[str]:
        try:
            return services.check_events(events)
        except ValueError as exc:
            raise serializers.ValidationError(str(exc)) from None

    def create(self, validated_data: dict[str, Any]) -> Webhook:
        return Webhook.objects.create(owner=self.context["request"].user, **validated_data)


class DeliverySerializer(serializers.ModelSerializer):
    class Meta:
        model = Delivery
        fields = [
            "id", "event_id", "event", "payload", "status", "attempts", "response_code", "response_excerpt",
            "last_error", "created_at", "finished_at",
        ]  # fmt: skip
        read_only_fields = fields
