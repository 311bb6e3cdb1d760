from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.api import ModelSerializer
from deployments.models import Adapter, ApiKey, Deployment, DeploymentEvent, Replica
from deployments.services import QUANTIZATION_CHOICES
from runs.models import Checkpoint, PretrainedModel
from serving.deployment_config import MAX_REPLICAS
from serving.routing import DEFAULT_POLICY, POLICIES


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


AUTOSCALING_HELP = (
    "Let the replica count follow the load (null: it stays at `replicas`): {min_replicas, max_replicas, "
    "target_waiting (mean requests waiting per replica above which one is added, default 1), window_s (how "
    "long, default 30), cooldown_s (how long the load must fit on one replica fewer before one is removed, "
    "default 300), idle_s (with min_replicas 0: how long without a request before it sleeps, default 600), "
    "wake_timeout_s (how long a request to a sleeping deployment is held, default 300)}."
)


@extend_schema_field({"type": "object", "nullable": True, "additionalProperties": True})
class AutoscalingField(serializers.JSONField):
    """The policy's fields and bounds are checked by deployments.autoscaling, naming the field."""


class AutoscalingSerializer(serializers.Serializer):
    autoscaling = AutoscalingField(allow_null=True, help_text=AUTOSCALING_HELP)


class ReplicaSerializer(ModelSerializer):
    class Meta:
        model = Replica
        fields = ["index", "url", "status", "restarts", "updated_at"]


class AdapterSerializer(ModelSerializer):
    """A LoRA run's checkpoint served on a deployment of its base under a model name of its own."""

    checkpoint = serializers.PrimaryKeyRelatedField(
        queryset=Checkpoint.objects.none(), help_text="A checkpoint of one of your LoRA runs on this deployment's base."
    )

    class Meta:
        model = Adapter
        fields = ["id", "name", "checkpoint", "created_at"]
        read_only_fields = ["created_at"]
        extra_kwargs = {"name": {"required": False, "help_text": "The model name clients send; default <run>-step<N>."}}

    def get_fields(self) -> dict[str, Any]:
        fields = super().get_fields()
        request = self.context.get("request")
        if request is not None and request.user.is_authenticated:
            fields["checkpoint"].queryset = Checkpoint.objects.filter(run__owner=request.user)  # type: ignore[attr-defined]
        return fields


class DeploymentSerializer(ModelSerializer):
    checkpoint = serializers.PrimaryKeyRelatedField(
        queryset=Checkpoint.objects.none(), required=False, allow_null=True,
        help_text="The checkpoint whose export it serves; or give `pretrained`.",
    )  # fmt: skip
    pretrained = serializers.PrimaryKeyRelatedField(
        queryset=PretrainedModel.objects.none(), required=False, allow_null=True,
        help_text="One of your pretrained models, served as it is (the base LoRA adapters are attached to); or give "
        "`checkpoint`.",
    )  # fmt: skip
    adapters = AdapterSerializer(many=True, read_only=True)
    routing = serializers.ChoiceField(
        choices=POLICIES,
        default=DEFAULT_POLICY,
        error_messages={"invalid_choice": f"must be one of {', '.join(POLICIES)}; got {{input!r}}"},
        help_text="How /v1 chooses a replica: prefix (requests sharing a prompt prefix go to one replica while its "
        "load stays within 1.25× the mean, so its prefix cache serves them), least_loaded or round_robin.",
    )
    merged = serializers.BooleanField(
        default=False,
        help_text="For a LoRA run's checkpoint: serve its adapters merged into its base as one model (else attach "
        "it to a deployment of its base).",
    )
    replicas = serializers.IntegerField(
        min_value=1, max_value=MAX_REPLICAS, default=1,
        help_text="How many replicas it starts with; with autoscaling, how many it runs now (0: asleep).",
    )  # fmt: skip
    autoscaling = AutoscalingField(required=False, allow_null=True, default=None, help_text=AUTOSCALING_HELP)
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
            "pretrained",
            "merged",
            "served_model_name",
            "replicas",
            "autoscaling",
            "routing",
            "options",
            "quantization",
            "quantized_export",
            "status",
            "status_reason",
            "replica_set",
            "adapters",
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
            fields["pretrained"].queryset = PretrainedModel.objects.filter(owner=request.user)  # type: ignore[attr-defined]
        return fields

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if (attrs.get("checkpoint") is None) == (attrs.get("pretrained") is None):
            raise serializers.ValidationError(
                {"checkpoint": ["give either a checkpoint (its export is served) or a pretrained model (pretrained)"]}
            )
        return attrs


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
