from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api import ModelSerializer
from deployments.models import ApiKey, Deployment, DeploymentEvent, Replica
from runs.models import Checkpoint
from serving.supervisor import MAX_REPLICAS


class ReplicaSerializer(ModelSerializer):
    class Meta:
        model = Replica
        fields = ["index", "url", "status", "restarts", "updated_at"]


class DeploymentSerializer(ModelSerializer):
    checkpoint = serializers.PrimaryKeyRelatedField(queryset=Checkpoint.objects.none())
    replicas = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, default=1)
    options = serializers.JSONField(default=dict, help_text="vLLM options (see serving.vllm).")
    replica_set = ReplicaSerializer(many=True, read_only=True)

    class Meta:
        model = Deployment
        fields = [
            "id", "name", "checkpoint", "served_model_name", "replicas", "options", "status", "status_reason",
            "replica_set", "last_seq", "created_at",
        ]
        read_only_fields = ["status", "status_reason", "last_seq", "created_at"]
        extra_kwargs = {"name": {"required": False}, "served_model_name": {"required": False}}

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            fields["checkpoint"].queryset = Checkpoint.objects.filter(run__owner=request.user)  # type: ignore[attr-defined]
        return fields


class DeploymentEventSerializer(ModelSerializer):
    class Meta:
        model = DeploymentEvent
        fields = ["seq", "kind", "time", "data"]


class ApiKeySerializer(ModelSerializer):
    class Meta:
        model = ApiKey
        fields = ["id", "name", "lookup", "created_at", "last_used_at", "revoked"]
        read_only_fields = ["lookup", "created_at", "last_used_at", "revoked"]
        extra_kwargs = {"name": {"required": False}}
