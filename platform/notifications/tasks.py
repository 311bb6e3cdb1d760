"""Celery tasks that send webhook deliveries (notifications.services says what they send)."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from notifications import services

# A receiver that is down is tried again after 2, 4, 8, … s (with jitter, capped at 10 min), 8
# times: about 17 minutes in all, long enough to ride out a deploy or a restart of the receiver.
RETRY_BACKOFF_SECONDS = 2
RETRY_BACKOFF_MAX_SECONDS = 600
MAX_RETRIES = 8


@shared_task
def fan_out(owner_id: int, event: str, subject: dict[str, Any], event_id: str) -> list[int]:
    return services.do_fan_out(owner_id, event, subject, event_id)


@shared_task(
    bind=True,
    autoretry_for=(services.RetryableDelivery,),
    retry_backoff=RETRY_BACKOFF_SECONDS,
    retry_backoff_max=RETRY_BACKOFF_MAX_SECONDS,
    max_retries=MAX_RETRIES,
)
def deliver(self: Task, delivery_id: int) -> str:
    # Each attempt looks the delivery up again: a webhook deleted meanwhile took it along.
    return services.do_deliver(delivery_id, final=self.request.retries >= MAX_RETRIES)
