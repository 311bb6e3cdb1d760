from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from rest_framework import serializers
from rest_framework.validators import UniqueValidator

from controlplane.api import ModelSerializer, Text
from hosts.models import DeviceClaim, Host, Quota

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$"


class DeviceSerializer(serializers.Serializer):
    index = serializers.IntegerField(min_value=0, max_value=4095)
    kind = serializers.ChoiceField(choices=["gpu", "cpu"])
    model = Text(required=False, allow_blank=True, max_length=200, default="")
    memory_mb = serializers.IntegerField(required=False, min_value=0, default=0)


class HeartbeatSerializer(serializers.Serializer):
    """What a host worker sends every few seconds (its first beat registers it)."""

    name = serializers.RegexField(NAME_PATTERN, help_text="The host's name; its queue is host.<name>.")  # type: ignore[assignment]
    address = Text(max_length=255, help_text="The address other hosts and the control plane reach it at.")
    devices = DeviceSerializer(many=True, max_length=4096)  # type: ignore[call-arg]
    labels = serializers.DictField(child=Text(max_length=200, allow_blank=True), required=False, default=dict)
    cores = serializers.IntegerField(min_value=0, max_value=65536, required=False, default=0)
    cpu_flags = serializers.ListField(
        child=serializers.RegexField(r"^[a-z0-9_.]{1,64}$"), required=False, default=list, max_length=1024,
        help_text="The CPU's feature flags (/proc/cpuinfo): which replica kernels the host can run.",
    )  # fmt: skip
    running = serializers.ListField(child=serializers.DictField(), required=False, default=list, max_length=10000)

    def validate_devices(self, devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
        keys = [(d["kind"], d["index"]) for d in devices]
        if len(set(keys)) != len(keys):
            raise serializers.ValidationError("each (kind, index) may appear once")
        return devices


class ClaimSerializer(ModelSerializer):
    class Meta:
        model = DeviceClaim
        fields = ["device", "run", "deployment", "node"]


class HostSerializer(ModelSerializer):
    kind = serializers.CharField(source="device_kind", read_only=True)
    claims = ClaimSerializer(many=True, read_only=True)
    free = serializers.SerializerMethodField()
    running = serializers.SerializerMethodField()

    class Meta:
        model = Host
        fields = [
            "id", "name", "address", "status", "kind", "devices", "cores", "free", "claims", "labels", "running",
            "last_seen", "registered_at",
        ]  # fmt: skip
        read_only_fields = fields

    def get_running(self, host: Host) -> list[Any]:
        """What the host worker last said it runs; nothing known of a lost host."""
        return [] if host.status == Host.Status.LOST else list(host.running)

    def get_free(self, host: Host) -> int:
        """Devices no run holds."""
        held = {claim.device for claim in host.claims.all()}
        return len([d for d in host.device_indexes if d not in held])


class QuotaSerializer(ModelSerializer):
    """A user's or a project's quota, as staff set it (`hosts.quotas` says what each limit does)."""

    user = serializers.SlugRelatedField(
        slug_field="username", queryset=get_user_model().objects.all(), required=False, allow_null=True,
        validators=[UniqueValidator(Quota.objects.all(), message="has a quota already: change that one")],
        help_text="The user it limits (a username); or set project.",
    )  # fmt: skip

    class Meta:
        model = Quota
        fields = ["id", "user", "project", "gpus", "cpu_slots", "queued_runs", "priority_ceiling", "preemptible"]

    def validate(self, data: dict[str, Any]) -> dict[str, Any]:
        user = data.get("user", getattr(self.instance, "user", None))
        project = data.get("project", getattr(self.instance, "project", None))
        if (user is None) == (project is None):
            raise serializers.ValidationError({"user": ["set exactly one of user and project"]})
        if project is not None and data.get("priority_ceiling") is not None:
            raise serializers.ValidationError({"priority_ceiling": ["is a user's: a project's runs take their owners' ceilings"]})
        return data


class LimitSerializer(serializers.Serializer):
    limit = serializers.IntegerField(allow_null=True, help_text="Empty: no limit.")
    in_use = serializers.IntegerField()


class HolderQuotaSerializer(serializers.Serializer):
    gpus = LimitSerializer()
    cpu_slots = LimitSerializer()
    queued_runs = LimitSerializer()


class ProjectQuotaSerializer(HolderQuotaSerializer):
    id = serializers.IntegerField()
    name = serializers.CharField()
    preemptible = serializers.BooleanField()


class MyQuotaSerializer(serializers.Serializer):
    priority_ceiling = serializers.IntegerField(allow_null=True, help_text="The highest priority you may submit; empty: none (staff).")
    user = HolderQuotaSerializer(help_text="What your runs hold and may hold.")
    projects = ProjectQuotaSerializer(many=True, help_text="Your projects that have a quota.")


class QueueEntrySerializer(serializers.Serializer):
    position = serializers.IntegerField(help_text="1: the next run offered room.")
    id = serializers.IntegerField()
    name = serializers.CharField(allow_null=True, help_text="Empty for a run you may not see.")
    owner = serializers.CharField()
    project = serializers.IntegerField(allow_null=True)
    priority = serializers.IntegerField()
    share = serializers.CharField(help_text="Whose recent use orders it among runs of its priority.")
    share_recent_slots = serializers.FloatField(help_text="That share's decayed mean of slots held (hosts/quotas.py).")
    needs = serializers.CharField()
    status_reason = serializers.CharField()
    reservation = serializers.DictField()
    created_at = serializers.DateTimeField()
