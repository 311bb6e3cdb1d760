"""Deployments of checkpoints (or of pretrained models) to vLLM replicas, the replicas, the LoRA
adapters they serve on their base, and the keys that call them."""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from django.conf import settings
from django.db import models

from controlplane.events import Event
from deployments.autoscaling import Autoscaling
from runs.models import Checkpoint, PretrainedModel, QuantizedExport
from serving.routing import DEFAULT_POLICY, POLICIES


class Deployment(models.Model):
    class Status(models.TextChoices):
        PENDING = "pending"
        STARTING = "starting"
        READY = "ready"
        DEGRADED = "degraded"  # some replicas are down; the rest serve
        STOPPING = "stopping"
        STOPPED = "stopped"
        FAILED = "failed"
        # Scaled to zero (autoscaling's min_replicas 0): no replica runs; the next request wakes it.
        ASLEEP = "asleep"

    ACTIVE = (Status.PENDING, Status.STARTING, Status.READY, Status.DEGRADED, Status.ASLEEP)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="deployments")
    name = models.CharField(max_length=200)
    # What it serves: a checkpoint's export, or one of the owner's pretrained models as it is
    # (the base a LoRA run's adapters are attached to). Exactly one of the two.
    checkpoint = models.ForeignKey(
        Checkpoint, on_delete=models.PROTECT, null=True, blank=True, related_name="deployments"
    )
    pretrained = models.ForeignKey(
        PretrainedModel, on_delete=models.PROTECT, null=True, blank=True, related_name="deployments"
    )
    # A LoRA run's checkpoint served as one whole model, its adapters merged into its base
    # (runs.exports.export_merged), rather than attached to a deployment of the base.
    merged = models.BooleanField(default=False)
    # The int8/int4 export its replicas serve (the API's `quantization`); null: the checkpoint's
    # own export. A deployment whose quantized export is not ready yet stays pending until the
    # quantize task, once it is, starts it.
    quantized_export = models.ForeignKey(
        QuantizedExport, on_delete=models.PROTECT, null=True, blank=True, related_name="deployments"
    )
    served_model_name = models.CharField(max_length=200, unique=True)
    # How many replicas it runs now: as created, or as its autoscaler last set it (0: asleep).
    replicas = models.PositiveIntegerField(default=1)
    # deployments.autoscaling.Autoscaling as a dict; null: `replicas` stays as it is.
    autoscaling = models.JSONField(null=True, blank=True)
    # The autoscaler's deployments.autoscaling.ScalerState between syncs.
    scaler = models.JSONField(default=dict, blank=True)
    # How /v1 chooses a replica (serving.routing): by prompt prefix (vLLM's prefix cache then
    # holds a shared system prompt on one replica), least loaded, or round robin.
    routing = models.CharField(max_length=20, choices=[(p, p) for p in POLICIES], default=DEFAULT_POLICY)
    options = models.JSONField(default=dict, blank=True, help_text="vLLM options, validated by serving.vllm.")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING, db_index=True)
    status_reason = models.TextField(blank=True)
    supervisor_pid = models.IntegerField(null=True, blank=True)
    last_seq = models.BigIntegerField(default=0)
    last_report_at = models.DateTimeField(null=True, blank=True)
    # How many bytes of each supervisor's events file are stored as events, by the supervisor
    # folder's path under the deployment folder ("." or "hosts/<host>"). In the row, so storing
    # events and moving the offset commit together: a sync that overlaps another or dies halfway
    # stores no event twice.
    event_offsets = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(checkpoint__isnull=False, pretrained__isnull=True)
                | models.Q(checkpoint__isnull=True, pretrained__isnull=False),
                name="deployment_serves_a_checkpoint_or_a_pretrained_model",
            )
        ]

    def __str__(self) -> str:
        return self.served_model_name

    @property
    def quantization(self) -> str:
        """The API's `quantization`: the scheme of the export it serves, or none."""
        return self.quantized_export.scheme if self.quantized_export else "none"

    @property
    def autoscaling_policy(self) -> Autoscaling | None:
        return Autoscaling.from_dict(self.autoscaling) if self.autoscaling is not None else None

    @property
    def folder(self) -> Path:
        return settings.DEPLOYMENTS_DIR / f"{self.pk}-{self.created_at:%Y%m%d-%H%M%S-%f}"


class Adapter(models.Model):
    """A LoRA run's checkpoint served by a deployment of its base as a model of its own (`name`),
    on the same replicas. Attaching or detaching one restarts no replica
    (`serving.replica_adapters`); a detached one's row is deleted."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=200, help_text="The model name clients send to use it.")
    checkpoint = models.ForeignKey(Checkpoint, on_delete=models.PROTECT, related_name="adapters")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["deployment", "created_at", "id"]
        constraints = [models.UniqueConstraint(fields=["deployment", "name"], name="adapter_name_unique")]

    def __str__(self) -> str:
        return f"{self.name} on {self.deployment}"


class Replica(models.Model):
    class Status(models.TextChoices):
        STARTING = "starting"
        READY = "ready"
        DEAD = "dead"
        STOPPED = "stopped"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replica_set")
    index = models.PositiveIntegerField()
    url = models.CharField(max_length=200, blank=True)
    pid = models.IntegerField(null=True, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.STARTING)
    restarts = models.IntegerField(default=0)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["deployment", "index"]
        constraints = [models.UniqueConstraint(fields=["deployment", "index"], name="replica_index_unique")]


class DeploymentEvent(Event):
    """Replica lifecycle and serving metrics, ordered per deployment like a run's events."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="events")

    class Meta:
        ordering = ["deployment", "seq"]
        constraints = [models.UniqueConstraint(fields=["deployment", "seq"], name="deployment_event_seq_unique")]


class ApiKey(models.Model):
    """A key for one deployment's OpenAI-compatible endpoint. Only its SHA-256 is stored.

    A revoked key is kept (not deleted) so its record of use stays readable. `requests` and the
    token counts are added up in each web process and written in batches (deployments.usage),
    so they trail the traffic by up to that module's FLUSH_S.
    """

    PREFIX = "fth-"

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True)
    lookup = models.CharField(max_length=16, unique=True, help_text="The first characters, shown to tell keys apart.")
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked = models.BooleanField(default=False)
    revoked_at = models.DateTimeField(null=True, blank=True)
    rate_limit_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="Requests per minute this key may make; empty for no limit."
    )
    requests = models.BigIntegerField(default=0, help_text="Requests made with this key.")
    prompt_tokens = models.BigIntegerField(default=0, help_text="Prompt tokens of the answered requests.")
    completion_tokens = models.BigIntegerField(default=0, help_text="Tokens generated for this key.")

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"{self.lookup}… ({self.deployment})"

    @staticmethod
    def hash(raw: str) -> str:
        return hashlib.sha256(raw.encode()).hexdigest()

    @classmethod
    def lookup_of(cls, raw: str) -> str:
        """The stored `lookup` of a key's secret: its first characters."""
        return raw[: len(cls.PREFIX) + 8]

    @classmethod
    def issue(
        cls, deployment: Deployment, name: str = "", rate_limit_per_minute: int | None = None
    ) -> tuple[ApiKey, str]:
        """Creates a key and returns it with its secret, which is never retrievable again."""
        raw = cls.PREFIX + secrets.token_urlsafe(32)
        key = cls.objects.create(
            deployment=deployment,
            name=name,
            lookup=cls.lookup_of(raw),
            key_hash=cls.hash(raw),
            rate_limit_per_minute=rate_limit_per_minute,
        )
        return key, raw
