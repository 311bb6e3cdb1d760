"""The machines that train and serve (each runs a host worker), and the devices given to runs."""

from __future__ import annotations

from typing import Any

from django.db import models


class Host(models.Model):
    """A machine whose host worker registered with the cluster's join token and heartbeats.

    `devices` is what the worker last reported: `[{"index", "kind" ("gpu" or "cpu"), "model",
    "memory_mb"}]`, GPUs from nvidia-smi or CPU slots on a host without one.
    """

    class Status(models.TextChoices):
        READY = "ready"
        DRAINING = "draining"  # keeps what it runs, takes nothing new
        LOST = "lost"  # no heartbeat for HOST_LOST_AFTER seconds

    name = models.CharField(max_length=100, unique=True, help_text="The host worker's name; its queue is host.<name>.")
    address = models.CharField(max_length=255, help_text="Where other hosts and the control plane reach it.")
    devices = models.JSONField(default=list)
    labels = models.JSONField(default=dict, blank=True)
    running = models.JSONField(default=list, blank=True, help_text="What the host worker last said it runs.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.READY, db_index=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.status})"

    @property
    def queue(self) -> str:
        return f"host.{self.name}"

    @property
    def device_kind(self) -> str:
        """The kind runs use on this host: "gpu" if it has a GPU, else "cpu"."""
        return "gpu" if any(d.get("kind") == "gpu" for d in self.devices) else "cpu"

    @property
    def device_indexes(self) -> list[int]:
        kind = self.device_kind
        return sorted(int(d["index"]) for d in self.devices if d.get("kind") == kind)

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "kind": self.device_kind}


class DeviceClaim(models.Model):
    """One device of one host given to one node of a run. The unique (host, device) pair is what
    makes double-booking impossible whatever the schedulers do: a second claim fails to insert."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="claims")
    device = models.IntegerField()
    run = models.ForeignKey("runs.Run", on_delete=models.CASCADE, related_name="device_claims")
    node = models.IntegerField(help_text="The run's node rank this device belongs to.")
    claimed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "node", "device"]
        constraints = [models.UniqueConstraint(fields=["host", "device"], name="device_claim_host_device_unique")]

    def __str__(self) -> str:
        return f"{self.host.name}:{self.device} → run {self.run_id} node {self.node}"
