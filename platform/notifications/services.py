"""Telling a user's webhooks that a run or deployment changed state.

The status changes call `notify_on_commit` inside the transaction that records them; the event is
queued only if that transaction commits. A worker builds the payload and one `Delivery` per
webhook (`do_fan_out`), then POSTs each (`do_deliver`), signed as receivers of Stripe's and
GitHub's webhooks expect:

    X-Fathom-Timestamp: <unix seconds>
    X-Fathom-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + raw body)>

The timestamp is inside the signed content, so a receiver that refuses old timestamps cannot be
sent a captured delivery again later.

A webhook hears only the events it chose (`Webhook.events`). Its URL must pass the outbound
address policy (controlplane.outbound) when it is saved and again, resolved, at each delivery,
which connects to the address that was checked; a delivery the policy refuses fails at once,
with the reason, and is never retried.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from controlplane import outbound
from controlplane.queue import enqueue_on_commit

# Re-exported: runs.services and deployments.services fan out from them through this module.
from notifications.events import DEPLOYMENT_EVENTS as DEPLOYMENT_EVENTS
from notifications.events import EVENTS
from notifications.events import GUARD_EVENTS as GUARD_EVENTS
from notifications.events import RUN_EVENTS as RUN_EVENTS
from notifications.models import Delivery, Webhook

# Lines of the failing rank's log a run.failed event carries: the traceback and what led to it,
# without making a payload receivers (chat hooks) would truncate.
FAILED_LOG_LINES = 40
# A receiver is expected to answer at once and do its work later (GitHub allows 10 s).
DELIVERY_TIMEOUT_SECONDS = 10.0
# What of a receiver's answer is kept for the settings page: enough to read an error message.
RESPONSE_EXCERPT_CHARS = 500

SIGNATURE_HEADER = "X-Fathom-Signature"
TIMESTAMP_HEADER = "X-Fathom-Timestamp"


class RetryableDelivery(Exception):
    """The receiver could not be reached or answered 5xx: worth trying again later."""


def check_url(url: str) -> str:
    """Refuses a URL a delivery could not be POSTed to: not http or https, or an address the
    outbound policy refuses (a name that does not resolve yet passes; each delivery checks it).
    Raises outbound.Refused, whose text names the reason."""
    return outbound.check_url(url, allowed=settings.WEBHOOK_ALLOW_NETWORKS)


def check_events(events: list[str]) -> list[str]:
    """A webhook's events: a non-empty list of names from EVENTS, each once, in EVENTS' order."""
    unknown = sorted(set(events) - set(EVENTS))
    if unknown:
        raise ValueError(f"{', '.join(unknown)} not among the events: {', '.join(EVENTS)}")
    if not events:
        raise ValueError(f"must name at least one of the events: {', '.join(EVENTS)}")
    return [event for event in EVENTS if event in events]


def notify_on_commit(owner_id: int, event: str, subject: dict[str, Any]) -> None:
    """Queues `event` about `subject` ({"run": id} or {"deployment": id}) for the owner's
    webhooks that hear it once the current transaction commits; nothing if it rolls back or
    none does."""
    # One indexed query: a user without webhooks for this event costs no task.
    if any(event in events for events in Webhook.objects.filter(owner_id=owner_id).values_list("events", flat=True)):
        enqueue_on_commit("notifications.tasks.fan_out", owner_id, event, subject, str(uuid.uuid4()))


def do_fan_out(owner_id: int, event: str, subject: dict[str, Any], event_id: str) -> list[int]:
    """Makes the event's deliveries to the owner's webhooks that hear it (once per event,
    however often this is called) and queues them. Returns their ids."""
    payload = {"id": event_id, "event": event, "created_at": timezone.now().isoformat(), **_describe(subject)}
    ids = []
    with transaction.atomic():
        for webhook in Webhook.objects.filter(owner_id=owner_id):
            # JSON containment has no SQLite lookup; a user has a handful of webhooks.
            if event not in webhook.events:
                continue
            delivery, made = Delivery.objects.get_or_create(
                webhook=webhook, event_id=event_id, defaults={"event": event, "payload": payload}
            )
            if made:
                enqueue_on_commit("notifications.tasks.deliver", delivery.pk)
            ids.append(delivery.pk)
    return ids


def _describe(subject: dict[str, Any]) -> dict[str, Any]:
    from deployments.models import Deployment
    from runs.models import Run

    if "run" in subject:
        run = Run.objects.get(pk=subject["run"])
        described: dict[str, Any] = {
            "run": {
                "id": run.pk,
                "name": run.name,
                "status": run.status,
                "reason": run.status_reason,
                "step": run.step,
                "restarts": run.restarts,
                "url": f"{settings.PUBLIC_URL}/runs/{run.pk}",
            }
        }
        if run.status == Run.Status.FAILED:
            described["log"] = _failing_rank_log(run)
        if "detail" in subject:  # the event that caused it, as the run reported it (a skipped step)
            described["detail"] = subject["detail"]
        return described
    deployment = Deployment.objects.get(pk=subject["deployment"])
    return {
        "deployment": {
            "id": deployment.pk,
            "name": deployment.name,
            "served_model_name": deployment.served_model_name,
            "status": deployment.status,
            "reason": deployment.status_reason,
            "url": f"{settings.PUBLIC_URL}/deployments/{deployment.pk}",
        }
    }


def _failing_rank_log(run: Any) -> dict[str, Any]:
    """The end of the log of the rank that failed the run: the agent names it in its `failed`
    event (or its reason, "rank 3 exited with …"); rank 0 when it names none."""
    from runs import logs

    failed = run.events.filter(kind="failed").order_by("-seq").first()
    rank = failed.data.get("rank") if failed is not None else None
    if not isinstance(rank, int):
        named = re.search(r"\brank (\d+)", run.status_reason)
        rank = int(named.group(1)) if named else 0
    return {"rank": rank, "lines": logs.tail(run, rank, FAILED_LOG_LINES)}


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The X-Fathom-Signature header's value for a body sent at `timestamp`."""
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return f"sha256={mac.hexdigest()}"


def do_deliver(delivery_id: int, *, final: bool) -> str:
    """POSTs one delivery and records the answer. Raises RetryableDelivery on a connection error
    (a name that does not resolve included) or a 5xx unless this is the `final` attempt, which
    marks the delivery failed instead. A URL the outbound policy refuses is never connected to:
    the delivery fails at once with the reason, keeping no earlier attempt's answer.

    Returns what became of it: "delivered", "failed", "retry" is raised, or "gone" when the
    webhook was deleted (its deliveries went with it) or the delivery was already settled."""
    delivery = Delivery.objects.select_related("webhook").filter(pk=delivery_id, status=Delivery.Status.PENDING).first()
    if delivery is None:
        return "gone"
    Delivery.objects.filter(pk=delivery_id).update(attempts=F("attempts") + 1)
    webhook = delivery.webhook
    body = json.dumps(delivery.payload, separators=(",", ":")).encode()
    timestamp = str(int(time.time()))
    headers = {
        "Content-Type": "application/json",
        "User-Agent": "Fathom-Webhooks",
        "X-Fathom-Event": delivery.event,
        "X-Fathom-Delivery": delivery.event_id,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(webhook.secret, timestamp, body),
    }
    try:
        with outbound.stream(
            "POST", webhook.url, allowed=settings.WEBHOOK_ALLOW_NETWORKS, content=body, headers=headers,
            timeout=DELIVERY_TIMEOUT_SECONDS,
        ) as response:  # fmt: skip
            code = response.status_code
            excerpt = outbound.read_capped(response, RESPONSE_EXCERPT_CHARS)
    except outbound.Refused as exc:
        # Final whatever the attempt: the same URL is refused the same way next time. What an
        # earlier attempt was answered (when the name still resolved elsewhere) is not kept.
        return _settle(
            delivery_id, True, retry=False, last_error=f"refused: url {exc}", response_code=None, response_excerpt=""
        )
    except (outbound.Unresolved, httpx.HTTPError) as exc:
        return _settle(delivery_id, final, retry=True, last_error=f"{type(exc).__name__}: {exc}")
    answer = {"response_code": code, "response_excerpt": excerpt}
    if 200 <= code < 300:
        Delivery.objects.filter(pk=delivery_id).update(
            status=Delivery.Status.DELIVERED, finished_at=timezone.now(), last_error="", **answer
        )
        return "delivered"
    # 5xx is the receiver's trouble and may pass; a 4xx (or a redirect, not followed: the
    # signature was made for this URL) will be answered the same next time.
    return _settle(delivery_id, final, retry=code >= 500, last_error=f"HTTP {code}", **answer)


def _settle(delivery_id: int, final: bool, *, retry: bool, last_error: str, **answer: Any) -> str:
    if retry and not final:
        Delivery.objects.filter(pk=delivery_id).update(last_error=last_error, **answer)
        raise RetryableDelivery(last_error)
    Delivery.objects.filter(pk=delivery_id, status=Delivery.Status.PENDING).update(
        status=Delivery.Status.FAILED, finished_at=timezone.now(), last_error=last_error, **answer
    )
    return "failed"
