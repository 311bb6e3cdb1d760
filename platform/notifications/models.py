"""Webhooks a user registers, and the record of each POST made to them."""

from __future__ import annotations

from django.conf import settings
from django.db import models

from notifications.events import all_events


class Webhook(models.Model):
    """A URL that hears about its owner's runs and deployments, signed with `secret`."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="webhooks")
    url = models.CharField(max_length=1000, help_text="http:// or https:// URL that receives the events.")
    # Kept in the clear: each delivery is signed with it (HMAC), so it cannot be stored hashed.
    secret = models.CharField(max_length=200, help_text="Key of the HMAC-SHA256 signature of each delivery.")
    # A list of names from notifications.events.EVENTS, never empty (the serializer checks).
    events = models.JSONField(default=all_events, help_text="The events it hears.")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.url


class Delivery(models.Model):
    """One event sent (or being sent) to one webhook. Deleted with its webhook, which is how a
    delivery still queued or waiting for a retry learns it must not be sent."""

    class Status(models.TextChoices):
        PENDING = "pending"  # queued or waiting for a retry
        DELIVERED = "delivered"  # the receiver answered 2xx
        FAILED = "failed"  # a 4xx, the retries ran out, or the address policy refused it

    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    # The event's id, the same for every webhook it goes to: a redelivered fan-out task finds the
    # rows it made, and a receiver can drop an event it already handled.
    event_id = models.CharField(max_length=36)
    event = models.CharField(max_length=40)
    payload = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.IntegerField(default=0)
    response_code = models.IntegerField(null=True, blank=True)
    response_excerpt = models.TextField(blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-pk"]
        constraints = [models.UniqueConstraint(fields=["webhook", "event_id"], name="one_delivery_per_event")]

    def __str__(self) -> str:
        return f"{self.event} → {self.webhook_id} ({self.status})"
