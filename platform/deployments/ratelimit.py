"""Per-key request limits for the OpenAI endpoint: at most N requests in any 60 seconds.

A sliding log, not fixed one-minute windows: fixed windows let 2N requests through across a
window's edge. A request over the limit is refused and not logged, and the answer says when the
oldest request in the log leaves the window (Retry-After).

Where the log lives follows the cache the settings configure, as the channel layer does:
- Redis (REDIS_URL): one sorted set per key, trimmed, counted and added to by one Lua script,
  so several web processes share the limit and Redis's clock decides. redis-py's asyncio
  client, not Django's cache API: Django runs a cache call of an async caller on the one thread
  its database calls share (openai.KeyCache says why that thread must stay free).
- the embedded default (local memory, one web process): a deque per key in this process.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from typing import Any, Protocol

from django.conf import settings

log = logging.getLogger(__name__)

WINDOW_S = 60.0


class Limiter(Protocol):
    async def wait_s(self, key: str, limit: int) -> float | None:
        """Counts a request of `key` (an API key's prefix: random, and never reused the way a
        row id is when a database starts over) against `limit` per WINDOW_S and returns None,
        or, when the limit is reached, does not count it and returns the seconds until one fits."""
        ...


class MemoryLimiter:
    """The log in this process's memory: right for the embedded default's one web process."""

    def __init__(self) -> None:
        self._logs: dict[str, deque[float]] = {}

    async def wait_s(self, key: str, limit: int) -> float | None:
        now = time.monotonic()
        log_ = self._logs.setdefault(key, deque())
        while log_ and log_[0] <= now - WINDOW_S:
            log_.popleft()
        if len(log_) < limit:
            log_.append(now)
            return None
        # A lowered limit leaves more than `limit` entries: wait for the one that makes room.
        return log_[len(log_) - limit] + WINDOW_S - now


# KEYS[1]: the key's log; ARGV: limit, window (µs), a member name unique to this request.
_SLIDING_LOG = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local window = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
local count = redis.call('ZCARD', KEYS[1])
local limit = tonumber(ARGV[1])
if count < limit then
  redis.call('ZADD', KEYS[1], now, ARGV[3])
  redis.call('PEXPIRE', KEYS[1], math.ceil(window / 1000))
  return -1
end
local making_room = redis.call('ZRANGE', KEYS[1], count - limit, count - limit, 'WITHSCORES')
return math.ceil(tonumber(making_room[2]) + window - now)
"""


class RedisLimiter:
    """The log in Redis, shared by every web process that uses the same Redis."""

    def __init__(self, url: str) -> None:
        self._url = url
        # redis-py's asyncio connections belong to the event loop that opened them.
        self._clients: dict[int, Any] = {}

    def _script(self) -> Any:
        loop_id = id(asyncio.get_running_loop())
        script = self._clients.get(loop_id)
        if script is None:
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(self._url)
            script = self._clients[loop_id] = client.register_script(_SLIDING_LOG)
        return script

    async def wait_s(self, key: str, limit: int) -> float | None:
        try:
            waited = await self._script()(
                keys=[f"fathom:ratelimit:{key}"],
                args=[limit, int(WINDOW_S * 1_000_000), uuid.uuid4().hex],
            )
        except Exception:
            # Redis down: serve rather than refuse everyone (the limit protects replicas from one
            # key's excess, it is not what keeps them up).
            log.warning("rate limit not checked: Redis did not answer", exc_info=True)
            return None
        return None if waited < 0 else waited / 1_000_000


def limiter_for_settings() -> Limiter:
    cache = settings.CACHES["default"]
    if cache["BACKEND"] == "django.core.cache.backends.redis.RedisCache":
        location = cache["LOCATION"]
        return RedisLimiter(location[0] if isinstance(location, list) else location)
    return MemoryLimiter()
