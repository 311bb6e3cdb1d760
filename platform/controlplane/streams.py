"""A websocket that replays an object's event history after the client's last seq, then goes live.

Runs and deployments both stream this way. The client says the last seq it holds in the URL
(`?after=SEQ`) or as its first message (`{"after": SEQ}`, within HANDSHAKE_SECONDS); otherwise
it gets the history from the start. Every event reaches the client once and in order: live
messages that arrive with a gap after what was sent are completed from the database first.
Events arrive in batches (one message per stored batch), so 1,000 points/s reach the browser
as a few dozen messages.
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.db.models import Model

from controlplane.events import events_after

# With the in-memory channel layer, events recorded by another process (a Celery worker) are
# not published to this one; the consumer also polls the database this often to catch them.
CATCH_UP_SECONDS = 1.0
# How long a client that gave no `?after=` has to send `{"after": SEQ}` before history starts.
HANDSHAKE_SECONDS = 0.5
# Events per message when replaying history.
REPLAY_BATCH = 2000


class EventStreamConsumer(AsyncJsonWebsocketConsumer):
    """Subclasses say which model the URL names and its channel group. The model has an `owner`
    and `events` (`controlplane.events.Event`); group messages of type `stream.events` carry
    `{"events": [...]}` with seqs."""

    url_kwarg = ""
    model: type[Model]
    subject: Any
    sent_seq = 0

    def load_owned(self, user: Any, object_id: int) -> Any | None:
        if user is None or not user.is_authenticated:
            return None
        return self.model._default_manager.filter(pk=object_id, owner=user).first()

    def group_for(self, object_id: int) -> str:
        raise NotImplementedError

    async def on_started(self) -> None:
        """Called once the history is sent; subclasses may start extra feeds."""

    async def connect(self) -> None:
        self.started = False
        self.tasks: list[asyncio.Task[None]] = []
        object_id = int(self.scope["url_route"]["kwargs"][self.url_kwarg])
        subject = await database_sync_to_async(self.load_owned)(self.scope.get("user"), object_id)
        if subject is None:
            await self.close(code=4404)
            return
        self.subject = subject
        self.group = self.group_for(object_id)
        self.lock = asyncio.Lock()
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        query = dict(part.partition("=")[::2] for part in self.scope.get("query_string", b"").decode().split("&") if part)
        if query.get("after", "").isdigit():
            self.sent_seq = int(query["after"])
            await self._start()
        else:
            self.tasks.append(asyncio.create_task(self._start_after_handshake()))

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)
        for task in getattr(self, "tasks", []):
            task.cancel()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if isinstance(content, dict) and "after" in content and not self.started:
            self.sent_seq = max(0, int(content.get("after") or 0))
            await self._start()

    async def _start_after_handshake(self) -> None:
        await asyncio.sleep(HANDSHAKE_SECONDS)
        if not self.started:
            await self._start()

    async def _start(self) -> None:
        self.started = True
        await self._send_from_db()
        if "InMemory" in settings.CHANNEL_LAYERS["default"]["BACKEND"]:
            self.tasks.append(asyncio.create_task(self._poll()))
        await self.on_started()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(CATCH_UP_SECONDS)
            await self._send_from_db()

    async def _send_from_db(self) -> None:
        async with self.lock:
            while True:
                events = await database_sync_to_async(events_after)(self.subject.events.all(), self.sent_seq, REPLAY_BATCH)
                if not events:
                    return
                await self.send_json({"type": "events", "events": events})
                self.sent_seq = events[-1]["seq"]

    async def stream_events(self, message: dict[str, Any]) -> None:
        if not self.started:
            return  # _start() will read these from the database
        events = message["events"]
        async with self.lock:
            if events and events[0]["seq"] <= self.sent_seq + 1:
                fresh = [e for e in events if e["seq"] > self.sent_seq]
                if fresh:
                    await self.send_json({"type": "events", "events": fresh})
                    self.sent_seq = fresh[-1]["seq"]
                return
        await self._send_from_db()  # a gap: fill it from the database, in order
