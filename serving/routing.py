"""Which replica of a deployment a request goes to, by the deployment's routing policy.

- `prefix` (the default): requests that share a prompt prefix (a system prompt, a conversation's
  earlier turns, the same document) go to the same replica, whose vLLM prefix cache then holds
  their KV blocks, while its load stays within a bound. This is consistent hashing with bounded
  loads (Mirrokni, Thorup and Zadimoghaddam, 2018), as KubeAI's and Envoy's prefix routing do: the
  first `PREFIX_CHARS` characters of the prompt hash onto a ring of the replicas (each at
  `VIRTUAL_NODES` points), and the request goes to the first replica clockwise whose load after
  it stays within `LOAD_BOUND` × the mean. A replica that is busy spills the prefix to the next
  one on the ring, and only that prefix's share moves when a replica comes or goes. It needs no
  state shared between web processes: the ring is a hash of the replicas' addresses, so every
  process makes the same choice for the same prefix and the same loads. KV-aware scoring (llm-d,
  Dynamo) would need each replica's block hashes, which vLLM publishes only as KV events over
  ZeroMQ; the ring gets most of the hits with none of that.
- `least_loaded`: the replica with the fewest requests; ties round-robin.
- `round_robin`: each replica in turn.

A replica's load is the larger of this process's requests in flight to it and the replica's own
running + waiting requests, read off its `/metrics` at most `ReplicaLoads.interval_s` ago: the
second counts the other web processes' requests too.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, Protocol, get_args
from urllib.parse import urlsplit

Policy = Literal["prefix", "least_loaded", "round_robin"]
POLICIES: tuple[str, ...] = get_args(Policy)
DEFAULT_POLICY: Policy = "prefix"
# How much of a prompt decides its replica: enough to hold a system prompt's start, so chats
# that share one share a replica; vLLM caches whole blocks of the same tokens anyway.
PREFIX_CHARS = 512
# A replica takes a prefix's request while its load after it is at most this × the mean load
# (rounded up): 1.25, the bound KubeAI uses, keeps most of a prefix on one replica and no replica
# far over the rest.
LOAD_BOUND = 1.25
VIRTUAL_NODES = 64


def prefix_of(path: str, body: dict[str, Any]) -> str | None:
    """The text a request's replica is chosen by: its prompt's first PREFIX_CHARS characters
    (a chat's turns in order, roles included). None when it has no text prompt."""
    if path.endswith("/chat/completions"):
        pieces: list[str] = []
        length = 0
        for message in body.get("messages") or ():
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # text parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            piece = f"{message.get('role', '')}\n{content if isinstance(content, str) else ''}\n"
            pieces.append(piece)
            length += len(piece)
            if length >= PREFIX_CHARS:
                break
        return "".join(pieces)[:PREFIX_CHARS] or None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if isinstance(prompt[0], str) else ",".join(map(str, prompt[:PREFIX_CHARS // 4]))
    return prompt[:PREFIX_CHARS] if isinstance(prompt, str) and prompt else None


def _hash(text: str) -> int:
    """A hash every process agrees on (Python's own `hash` of a str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class HashRing:
    """The replicas at VIRTUAL_NODES points each of a ring of 64-bit hashes."""

    def __init__(self, keys: frozenset[str]) -> None:
        points = sorted((_hash(f"{key}#{i}"), key) for key in keys for i in range(VIRTUAL_NODES))
        self._hashes = [h for h, _ in points]
        self._keys = [k for _, k in points]
        self.size = len(keys)

    def clockwise(self, text: str) -> Iterator[str]:
        """Each replica once, in the order met walking the ring from `text`'s hash."""
        start = bisect.bisect(self._hashes, _hash(text))
        seen: set[str] = set()
        for i in range(len(self._keys)):
            key = self._keys[(start + i) % len(self._keys)]
            if key not in seen:
                seen.add(key)
                yield key
                if len(seen) == self.size:
                    return


class Chooser(Protocol):
    def choose(self, candidates: list[str], load: Callable[[str], int], prefix: str | None) -> str:
        """One of `candidates` (replica keys, never empty) for a request with this prompt prefix."""
        ...


class LeastLoaded:
    def __init__(self) -> None:
        self._tiebreak = itertools.count()

    def choose(self, candidates: list[str], load: Callable[[str], int], prefix: str | None) -> str:
        loads = [load(key) for key in candidates]
        least = min(loads)
        tied = [key for key, n in zip(candidates, loads, strict=True) if n == least]
        return tied[next(self._tiebreak) % len(tied)]


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list[str], load: Callable[[str], int], prefix: str | None) -> str:
        return candidates[next(self._turn) % len(candidates)]


class PrefixAffinity:
    """Consistent hashing with bounded loads (the module's docstring); a request without a text
    prompt goes to the least loaded replica."""

    def __init__(self) -> None:
        self._rings: dict[frozenset[str], HashRing] = {}
        self._fallback = LeastLoaded()

    def choose(self, candidates: list[str], load: Callable[[str], int], prefix: str | None) -> str:
        if prefix is None or len(candidates) == 1:
            return self._fallback.choose(candidates, load, prefix)
        members = frozenset(candidates)
        ring = self._rings.get(members)
        if ring is None:
            if len(self._rings) > 64:  # replicas come and go (a restart's new port): keep the recent
                self._rings.clear()
            ring = self._rings[members] = HashRing(members)
        loads = {key: load(key) for key in candidates}
        bound = math.ceil(LOAD_BOUND * (sum(loads.values()) + 1) / len(candidates))
        for key in ring.clockwise(prefix):
            if loads[key] + 1 <= bound:
                return key
        return min(candidates, key=loads.__getitem__)  # not reached: some replica is at most the mean


def chooser(policy: str) -> Chooser:
    if policy == "prefix":
        return PrefixAffinity()
    if policy == "least_loaded":
        return LeastLoaded()
    if policy == "round_robin":
        return RoundRobin()
    raise ValueError(f"routing must be one of {', '.join(POLICIES)}; got {policy!r}")


_COUNTED = (b"vllm:num_requests_running{", b"vllm:num_requests_waiting{")


async def _metrics_page(url: str, timeout_s: float) -> bytes:
    """The body of GET `url`/metrics, as HTTP/1.0 (one plain body, the connection closed after):
    a few lines of asyncio, where an HTTP client would log every one of these reads."""
    parts = urlsplit(url)
    async with asyncio.timeout(timeout_s):
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            writer.write(f"GET /metrics HTTP/1.0\r\nHost: {parts.netloc}\r\n\r\n".encode())
            answer = await reader.read()
        finally:
            writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    if not head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")):
        raise OSError(f"{url}/metrics answered {head[:40]!r}")
    return body


def requests_in(metrics: bytes) -> int:
    """Running + waiting requests of a vLLM `/metrics` page (summed over its engines)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(_COUNTED):
            with contextlib.suppress(ValueError, IndexError):
                total += float(line.rsplit(b" ", 1)[1])
    return int(total)


class ReplicaLoads:
    """Each replica's own running + waiting requests, read off its `/metrics` every `interval_s`
    while the router is used: a request starts the reading in the router's loop, and it stops
    after `idle_s` without one."""

    def __init__(self, urls: Callable[[], list[str]], interval_s: float = 1.0, idle_s: float = 30.0) -> None:
        self.interval_s = interval_s
        self._idle_s = idle_s
        self._urls = urls
        self._counts: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._asked_at = 0.0

    def of(self, url: str) -> int:
        self._asked_at = time.monotonic()
        self._start()
        return self._counts.get(url, 0)

    def _start(self) -> None:
        if self._task is None or self._task.done():
            try:
                self._task = asyncio.get_running_loop().create_task(self._read_every_interval())
            except RuntimeError:  # no loop: a synchronous caller, who gets the last counts
                pass

    async def _read_every_interval(self) -> None:
        while time.monotonic() - self._asked_at < self._idle_s:
            urls = self._urls()
            pages = await asyncio.gather(*(_metrics_page(url, self.interval_s) for url in urls), return_exceptions=True)
            self._counts = {url: requests_in(page) for url, page in zip(urls, pages, strict=True) if isinstance(page, bytes)}
            await asyncio.sleep(self.interval_s)
        self._counts = {}  # stale by the next request: it starts reading again

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
