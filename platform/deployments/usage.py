"""Each API key's record of use (requests, tokens, last use), written in batches.

The OpenAI endpoint must not pay a database write per request: Django runs every database call
of an async app on one shared thread, and a burst of a hundred chats would queue a hundred
UPDATEs there while the event loop waits for the GIL (see openai.KeyCache). So each web process
adds up its requests per key in memory and writes the sums at most every FLUSH_S, all keys in
one transaction. The writes add (`requests = requests + n`), so several web processes may
flush the same key without losing counts. What a process counted in its last FLUSH_S is
written when it exits normally (atexit); a killed process loses that much.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import sys
import threading
from dataclasses import dataclass, field
from datetime import datetime

from channels.db import database_sync_to_async
from django.db import transaction
from django.db.models import F, Value
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from deployments.models import ApiKey

log = logging.getLogger(__name__)
# How long counts wait in memory before they are written: the API and the page show use this
# much behind. One write per key per interval, whatever the traffic.
FLUSH_S = 2.0


@dataclass
class KeyUse:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    last_used_at: datetime = field(default_factory=timezone.now)


class UsageRecorder:
    """Counts per key, and one flush at a time that writes them."""

    def __init__(self) -> None:
        self._pending: dict[int, KeyUse] = {}
        # Taken only to swap the pending dict out; records come from event loops, the exit flush
        # from the main thread.
        self._lock = threading.Lock()
        self._flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is scheduled on

    def record(self, key_id: int, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """Counts one request with `key_id` (and the tokens it used, when known). Called from
        the event loop; never waits for the database."""
        with self._lock:
            use = self._pending.get(key_id)
            if use is None:
                use = self._pending[key_id] = KeyUse()
            use.requests += 1
            use.prompt_tokens += prompt_tokens
            use.completion_tokens += completion_tokens
            use.last_used_at = timezone.now()
            # A web process runs one loop for good; a loop that closed (a test's) took its timer along.
            loop = asyncio.get_running_loop()
            schedule = self._flush_loop is None or self._flush_loop.is_closed()
            if schedule:
                self._flush_loop = loop
        if schedule:
            loop.call_later(FLUSH_S, self._start_flush)

    def _start_flush(self) -> None:
        asyncio.ensure_future(self._flush_logged())

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except Exception:  # the counts of one interval are lost; serving goes on
            log.exception("could not write API key usage")

    async def flush(self) -> None:
        """Writes what was counted so far (tests call it instead of waiting FLUSH_S)."""
        batch = self._take()
        if batch:
            await database_sync_to_async(write)(batch)

    def flush_now(self) -> None:
        """The synchronous flush, for the end of the process (no event loop runs then)."""
        batch = self._take()
        if batch:
            try:
                write(batch)
            except Exception as exc:  # the database went first (a test's is dropped before exit)
                # Not through logging: its handlers may be closed by now.
                print(f"fathom: API key usage not written at exit: {exc}", file=sys.__stderr__)

    def _take(self) -> dict[int, KeyUse]:
        with self._lock:
            batch, self._pending = self._pending, {}
            self._flush_loop = None
        return batch


def write(batch: dict[int, KeyUse]) -> None:
    """Adds each key's counts to its row, in one transaction. last_used_at only moves forward:
    another process may flush an older use of the same key after this one."""
    with transaction.atomic():
        for key_id, use in batch.items():
            ApiKey.objects.filter(pk=key_id).update(
                requests=F("requests") + use.requests,
                prompt_tokens=F("prompt_tokens") + use.prompt_tokens,
                completion_tokens=F("completion_tokens") + use.completion_tokens,
                # Coalesce: SQLite's MAX() of a NULL is NULL (PostgreSQL's GREATEST skips it).
                last_used_at=Greatest(Coalesce(F("last_used_at"), Value(use.last_used_at)), Value(use.last_used_at)),
            )


USAGE = UsageRecorder()
atexit.register(USAGE.flush_now)
