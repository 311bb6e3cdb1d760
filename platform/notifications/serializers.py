from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api import ModelSerializer
from notifications import services
from notifications.models import Delivery, Webhook


class WebhookSerializer(ModelSerializer):
    """A webhook. Its secret is write-only: it is never shown again after it is set."""

    events = serializers.SerializerMethodField(help_text="The events every webhook receives.")

    class Meta:
        model = Webhook
        fields = ["id", "url", "secret", "events", "created_at"]
        read_only_fields = ["id", "created_at"]
        extra_kwargs = {"secret": {"write_only": True, "min_length": 16}}

    def get_events(self, webhook: Webhook) -> list[str]:
        return services.EVENTS

    def validate_url(self, url: str) -> str:
        try:
            return services.check_url(url)
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
