"""The event history that runs and deployments share: one ordered stream per object.

An object's events are numbered by a run-wide (deployment-wide) `seq` with no gaps, reserved on
the object's own `last_seq` column; an event is stored in the transaction that changes what it
announces and published to the object's channel group only after that transaction commits, so
a page never shows what the database does not hold. Websocket clients and the REST history read
on from the last `seq` they hold (`events_after`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import models, transaction
from django.db.models import F, QuerySet


class Event(models.Model):
    """One thing that happened to an object. Subclasses add the foreign key to the object (named
    `events` on it) and the uniqueness of (object, seq)."""

    seq = models.BigIntegerField()
    kind = models.CharField(max_length=32, db_index=True)
    time = models.DateTimeField()
    data = models.JSONField(default=dict)

    class Meta:
        abstract = True

    def message_fields(self) -> dict[str, Any]:
        """What a subclass adds to every message besides seq, kind, time and the data."""
        return {}

    def as_message(self) -> dict[str, Any]:
        """The event as websocket clients and pages read it: its data's keys at the top level."""
        return self.message(self.seq, self.kind, self.time, self.data, **self.message_fields())

    @staticmethod
    def message(seq: int, kind: str, time: datetime, data: dict[str, Any], **fields: Any) -> dict[str, Any]:
        """`as_message` of an event written without a model instance (`controlplane.bulk`)."""
        return {"seq": seq, "kind": kind, "time": time.timestamp(), **fields, **data}


def reserve_seqs(model: type[models.Model], pk: int, count: int, **also: Any) -> int:
    """Reserves `count` sequence numbers on row `pk` of `model` (its `last_seq`) and returns the
    first; `also` are other columns to set in the same UPDATE. Call inside a transaction.

    The UPDATE takes the row lock before reading, so two writers never get the same numbers (on
    SQLite the IMMEDIATE transaction serialises writers instead).
    """
    manager = model._default_manager
    manager.filter(pk=pk).update(last_seq=F("last_seq") + count, **also)
    last = manager.values_list("last_seq", flat=True).get(pk=pk)
    return int(last) - count + 1


def publish(group: str, messages: list[dict[str, Any]]) -> None:
    """Sends event messages to a channel group now (websocket consumers relay them)."""
    layer = get_channel_layer()
    if layer is not None:
        async_to_sync(layer.group_send)(group, {"type": "stream.events", "events": messages})


def publish_on_commit(group: str, messages: list[dict[str, Any]]) -> None:
    """Publishes once the current transaction commits; nothing if it rolls back."""
    if messages:
        transaction.on_commit(lambda: publish(group, messages))


def publish_many_on_commit(by_group: dict[str, list[dict[str, Any]]]) -> None:
    """`publish_on_commit` for many groups at once (a placement pass's runs): one trip into the
    channel layer's event loop for all of them, not one each."""
    if not by_group:
        return
    layer = get_channel_layer()

    async def send_all() -> None:
        for group, messages in by_group.items():
            await layer.group_send(group, {"type": "stream.events", "events": messages})

    if layer is not None:
        transaction.on_commit(async_to_sync(send_all))


def events_after(events: QuerySet[Any], after: int, limit: int) -> list[dict[str, Any]]:
    """Messages of the events with a seq above `after`, in order, at most `limit`."""
    return [e.as_message() for e in events.filter(seq__gt=after).order_by("seq")[:limit]]
