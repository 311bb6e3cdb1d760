from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.api import ModelSerializer
from deployments.models import ApiKey, Deployment, DeploymentEvent, Replica
from deployments.services import QUANTIZATION_CHOICES
from runs.models import Checkpoint
from serving.deployment_config import MAX_REPLICAS


@extend_schema_field({"type": "object", "additionalProperties": True})
class OptionsField(serializers.JSONField):
    """A JSON object of vLLM options; which keys and values a checkpoint takes is checked at create
    (deployments.options), so the schema states only that it is an object."""

    default_error_messages = {"not_an_object": "must be an object of vLLM options (see serving.vllm); got {kind}"}

    def to_internal_value(self, data: Any) -> Any:
        value = super().to_internal_value(data)
        if not isinstance(value, dict):
            kind = {list: "an array", str: "a string", bool: "a boolean"}.get(type(value), "a number")
            self.fail("not_an_object", kind=kind)
        return value


class ReplicaSerializer(ModelSerializer):
    class Meta:
        model = Replica
        fields = ["index", "url", "status", "restarts", "updated_at"]


class DeploymentSerializer(ModelSerializer):
    checkpoint = serializers.PrimaryKeyRelatedField(queryset=Checkpoint.objects.none())
    replicas = serializers.IntegerField(min_value=1, max_value=MAX_REPLICAS, default=1)
    options = OptionsField(default=dict, help_text="vLLM options (see serving.vllm).")
    replica_set = ReplicaSerializer(many=True, read_only=True)
    quantization = serializers.ChoiceField(
        choices=QUANTIZATION_CHOICES,
        default="none",
        error_messages={"invalid_choice": f"must be one of {', '.join(QUANTIZATION_CHOICES)}; got {{input!r}}"},
        help_text="Serve the checkpoint's own export (none) or an int8 (W8A8) / int4 (W4A16) export Fathom makes "
        "from it with llmcompressor, first if there is none yet. fp8 is options.quantization.",
    )

    class Meta:
        model = Deployment
        fields = [
            "id",
            "name",
            "checkpoint",
            "served_model_name",
            "replicas",
            "options",
            "quantization",
            "quantized_export",
            "status",
            "status_reason",
            "replica_set",
            "last_seq",
            "created_at",
        ]
        read_only_fields = ["status", "status_reason", "last_seq", "created_at", "quantized_export"]
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
    """A key as it is listed: never its secret, which only the answer that creates it holds."""

    prefix = serializers.CharField(source="lookup", read_only=True, help_text="The key's first characters.")
    rate_limit_per_minute = serializers.IntegerField(
        min_value=1,
        max_value=1_000_000,
        required=False,
        allow_null=True,
        help_text="Requests per minute this key may make (any 60 s); null for no limit. Over it, /v1 answers 429.",
    )
    tokens = serializers.SerializerMethodField(help_text="prompt_tokens + completion_tokens.")

    class Meta:
        model = ApiKey
        fields = [
            "id", "name", "prefix", "created_at", "last_used_at", "revoked", "revoked_at", "rate_limit_per_minute",
            "requests", "prompt_tokens", "completion_tokens", "tokens",
        ]  # fmt: skip
        read_only_fields = [
            "created_at", "last_used_at", "revoked", "revoked_at", "requests", "prompt_tokens", "completion_tokens",
        ]  # fmt: skip
        extra_kwargs = {"name": {"required": False}}

    def get_tokens(self, key: ApiKey) -> int:
        return key.prompt_tokens + key.completion_tokens


class NewApiKeySerializer(ApiKeySerializer):
    """The answer to creating a key: the key as listed, and its secret, shown this once."""

    key = serializers.CharField(read_only=True, help_text="The secret: send it as 'Authorization: Bearer <key>'.")

    class Meta(ApiKeySerializer.Meta):
        fields = [*ApiKeySerializer.Meta.fields, "key"]


class ShippedPieceSerializer(serializers.Serializer):
    """A piece of a file of a host's supervisor folder, from its shipper (serving.shipper)."""

    host = serializers.CharField(max_length=255, help_text="The shipping host's name.")
    probe = serializers.CharField(max_length=64, help_text="The token the shipper wrote into its folder.")
    file = serializers.CharField(max_length=64, help_text="state.json, events.jsonl, supervisor.log or logs/replica-<N>.log.")
    offset = serializers.IntegerField(min_value=0, help_text="Where in the host's file `chunk` starts (0 for state.json).")
    chunk = serializers.CharField(allow_blank=True, max_length=2 * 1024 * 1024, help_text="Base64 bytes, at most 1 MiB.")
