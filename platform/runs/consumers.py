"""`/ws/runs/<id>/`: a run's history after the client's last seq, then its live events.

The client says the last seq it holds in the URL (`?after=SEQ`) or as its first message
(`{"after": SEQ}`, within HANDSHAKE_SECONDS); otherwise it gets the history from the start.
Every event reaches the client once and in order: live messages that arrive with a gap after
what was sent are completed from the database first. Metrics arrive in batches (one message
per ingested batch), so 1,000 points/s reach the browser as a few dozen messages.
"""

from __future__ import annotations

import asyncio
from typing import Any

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings

from runs import services
from runs.models import Run

# With the in-memory channel layer, events recorded by another process (a Celery worker) are
# not published to this one; the consumer also polls the database this often to catch them.
CATCH_UP_SECONDS = 1.0
# How often rank 0's log file is checked for new lines to stream.
LOG_POLL_SECONDS = 1.0
# How long a client that gave no `?after=` has to send `{"after": SEQ}` before history starts.
HANDSHAKE_SECONDS = 0.5


class RunConsumer(AsyncJsonWebsocketConsumer):
    run: Run
    sent_seq = 0

    async def connect(self) -> None:
        user = self.scope.get("user")
        run_id = int(self.scope["url_route"]["kwargs"]["run_id"])
        run = await _owned_run(user, run_id)
        if run is None:
            await self.close(code=4404)
            return
        self.run = run
        self.group = services.run_group(run_id)
        self.lock = asyncio.Lock()
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self.started = False
        self.catch_up: asyncio.Task[None] | None = None
        query = dict(part.partition("=")[::2] for part in self.scope.get("query_string", b"").decode().split("&") if part)
        if query.get("after", "").isdigit():
            self.sent_seq = int(query["after"])
            await self._start()
        else:
            self.handshake = asyncio.create_task(self._start_after_handshake())

    async def _start_after_handshake(self) -> None:
        await asyncio.sleep(HANDSHAKE_SECONDS)
        if not self.started:
            await self._start()

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)
        for task in (getattr(self, "catch_up", None), getattr(self, "handshake", None), getattr(self, "log_tail", None)):
            if task is not None:
                task.cancel()

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        if isinstance(content, dict) and "after" in content and not self.started:
            self.sent_seq = max(0, int(content.get("after") or 0))
            await self._start()

    async def _start(self) -> None:
        self.started = True
        await self._send_from_db()
        if "InMemory" in settings.CHANNEL_LAYERS["default"]["BACKEND"]:
            self.catch_up = asyncio.create_task(self._poll())
        self.log_tail = asyncio.create_task(self._stream_log())

    async def _stream_log(self) -> None:
        """New lines of rank 0's log, from where the file ended at connect (the API serves the rest)."""
        path = self.run.folder / "logs" / "rank0.log"
        offset = path.stat().st_size if path.exists() else 0
        while True:
            await asyncio.sleep(LOG_POLL_SECONDS)
            size = path.stat().st_size if path.exists() else 0
            if size < offset:
                offset = 0  # the file was replaced
            if size <= offset:
                continue
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read(256 * 1024)
            complete = chunk[: chunk.rfind(b"\n") + 1]  # only whole lines; the rest comes next time
            if complete:
                offset += len(complete)
                lines = complete.decode(errors="replace").splitlines()
                await self.send_json({"type": "logs", "rank": 0, "lines": lines})

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(CATCH_UP_SECONDS)
            await self._send_from_db()

    async def _send_from_db(self) -> None:
        async with self.lock:
            while True:
                events = await database_sync_to_async(services.events_after)(self.run, self.sent_seq, 2000)
                if not events:
                    return
                await self.send_json({"type": "events", "events": events})
                self.sent_seq = events[-1]["seq"]

    async def run_events(self, message: dict[str, Any]) -> None:
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


@database_sync_to_async
def _owned_run(user: Any, run_id: int) -> Run | None:
    if user is None or not user.is_authenticated:
        return None
    return Run.objects.filter(pk=run_id, owner=user).first()
