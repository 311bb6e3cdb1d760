from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api import ModelSerializer, Text
from hosts.models import DeviceClaim, Host

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
