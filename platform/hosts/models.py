"""The machines that train and serve (each runs a host worker), and the devices given to runs."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.db import models

from serving.vllm import DeviceInfo


def running_keys(running: list[Any]) -> set[str]:
    """The keys of what a host's beat says it runs (`run-7-node-1`, `deployment-3`)."""
    return {str(item.get("key", "")) for item in running if isinstance(item, dict)}


class Host(models.Model):
    """A machine whose host worker joined with the cluster's join token and heartbeats with the
    secret it was given then.

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
    cores = models.IntegerField(default=0, help_text="CPU cores the host reports (CPU replicas are pinned to them).")
    cpu_flags = models.JSONField(
        default=list, blank=True, help_text="The host CPU's feature flags: which replica kernels it can run."
    )
    running = models.JSONField(default=list, blank=True, help_text="What the host worker last said it runs.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.READY, db_index=True)
    last_seen = models.DateTimeField(null=True, blank=True)
    registered_at = models.DateTimeField(auto_now_add=True)
    # SHA-256 of the secret given to the host when it joined, which its later heartbeats carry
    # instead of the cluster's join token: no host can then speak for another. A random 256-bit
    # secret needs no slow password hash. Empty: a host that joined before hosts had secrets.
    secret_sha256 = models.CharField(max_length=64, blank=True, default="", editable=False)

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

    def serving_device(self) -> DeviceInfo:
        """The device a replica placed here runs on, as the host reported it (flags it never
        reported are unknown, and vLLM on the host has the last word)."""
        if self.device_kind == "gpu":
            return DeviceInfo(kind="cuda")
        return DeviceInfo(kind="cpu", cpu_flags=frozenset(self.cpu_flags))

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "address": self.address, "kind": self.device_kind}


class DeviceClaim(models.Model):
    """One device of one host given to one node of a run, or to one replica of a deployment. The
    unique (host, device) pair is what makes double-booking impossible whatever the schedulers
    do: a second claim fails to insert."""

    host = models.ForeignKey(Host, on_delete=models.CASCADE, related_name="claims")
    device = models.IntegerField()
    run = models.ForeignKey("runs.Run", null=True, blank=True, on_delete=models.CASCADE, related_name="device_claims")
    deployment = models.ForeignKey(
        "deployments.Deployment", null=True, blank=True, on_delete=models.CASCADE, related_name="device_claims"
    )
    node = models.IntegerField(help_text="The run's node rank, or the deployment's replica index, this device serves.")
    claimed_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["run", "deployment", "node", "device"]
        constraints = [
            models.UniqueConstraint(fields=["host", "device"], name="device_claim_host_device_unique"),
            models.CheckConstraint(
                condition=models.Q(run__isnull=False, deployment__isnull=True)
                | models.Q(run__isnull=True, deployment__isnull=False),
                name="device_claim_for_a_run_or_a_deployment",
            ),
        ]

    def __str__(self) -> str:
        holder = f"run {self.run_id} node" if self.run_id else f"deployment {self.deployment_id} replica"
        return f"{self.host.name}:{self.device} → {holder} {self.node}"


class Quota(models.Model):
    """What one user, or one project, may hold and queue on the cluster; staff set it (the admin,
    `/api/quotas/`). An empty limit is no limit; a user or project without a row has none, and
    a user's priority ceiling is then `settings.DEFAULT_PRIORITY_CEILING`. A run in a project
    counts against both its owner's quota and the project's (`hosts.quotas`)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="quota"
    )
    project = models.OneToOneField(
        "runs.Project", null=True, blank=True, on_delete=models.CASCADE, related_name="quota"
    )
    gpus = models.PositiveIntegerField(null=True, blank=True, help_text="GPUs its runs may hold at once; empty: no limit.")
    cpu_slots = models.PositiveIntegerField(
        null=True, blank=True, help_text="CPU slots its runs may hold at once; empty: no limit."
    )
    queued_runs = models.PositiveIntegerField(
        null=True, blank=True, help_text="Runs it may have waiting in the queue; a submit beyond is refused. Empty: no limit."
    )
    priority_ceiling = models.IntegerField(
        null=True, blank=True, help_text="A user's highest priority at submit; empty: the install's default."
    )
    preemptible = models.BooleanField(
        default=True, help_text="A project's runs may be stopped (checkpointed, queued again) for higher-priority runs."
    )

    class Meta:
        ordering = ["id"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(user__isnull=False, project__isnull=True)
                | models.Q(user__isnull=True, project__isnull=False),
                name="quota_of_a_user_or_a_project",
            ),
        ]

    def __str__(self) -> str:
        return f"quota of user {self.user_id}" if self.user_id else f"quota of project {self.project_id}"
