"""Route OpenAI requests to a healthy replica of a deployment, by its routing policy.

Layers, as in TGI: the HTTP view (Django's, or `serving.app` standalone) validates with
`serving.openai_requests.check_request` and calls `Router.forward`; the router depends only on the
small `Backend` interface; `HttpBackend` is the vLLM replica behind it. Everything is async, so a
stream costs a coroutine, not a thread. The hop to a replica is `serving.replica_http`, pooled
connections that parse answers in C (httptools): relaying each token's SSE event is the router's
whole per-token cost, and a general client's reading path was nearly half of it (that module
says what was measured).

Choice: among routable replicas (the source says ready, and this router has not seen a
connection to it fail in the last `eject_s`), the one the deployment's policy picks
(`serving.routing`: by prompt prefix, the default; least loaded; round robin), a replica's load
being the larger of this router's requests in flight to it and its own running + waiting
requests. Failover: if a replica refuses the connection or drops it before
the response head, the request goes to the next replica (nothing was generated, so nothing is
repeated). Once bytes flow, a failure ends the response with an OpenAI error (a final SSE
`data: {"error": ...}` event for streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from serving.openai_errors import (
    OpenAIError,
    model_not_found,
    no_replica_available,
    normalize_error_body,
    upstream_failed,
    upstream_timeout,
)
from serving.replica_http import BackendBrokeOff, BackendTimeout, BackendUnavailable, ReplicaPool
from serving.routing import DEFAULT_POLICY, ReplicaLoads, chooser, prefix_of
from serving.state import read_state, state_files

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEndpoint:
    key: str  # stable identity across re-reads (the url: a restarted replica gets a new port)
    url: str
    # The LoRA adapters it serves besides the base model (the requests for one go only to
    # replicas that serve it).
    adapters: frozenset[str] = frozenset()


class ReplicaSource(Protocol):
    def endpoints(self) -> list[ReplicaEndpoint]:
        """Replicas that may receive requests now."""
        ...


@dataclass(frozen=True)
class StaticReplicas:
    urls: tuple[str, ...]

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [ReplicaEndpoint(u, u) for u in self.urls]


class StateFileReplicas:
    """The routable replicas of a deployment's state files (`DeploymentState.routable`: one file
    per supervisor), re-read when one changes.

    The folder is looked at most every `rescan_s`: a burst of requests then costs one directory
    scan, not one each (a scan is 0.1 ms on a cold cache). A replica that goes down between two
    scans is failed over like any refused connection."""

    def __init__(self, state_dir: str | Path, *, rescan_s: float = 0.1) -> None:
        self._state_dir = Path(state_dir)
        self._rescan_s = rescan_s
        self._scanned_at = -math.inf
        self._stamp: tuple[tuple[int, int], ...] | None = None
        self._endpoints: list[ReplicaEndpoint] = []

    def endpoints(self) -> list[ReplicaEndpoint]:
        now = time.monotonic()
        if now - self._scanned_at < self._rescan_s:
            return self._endpoints
        self._scanned_at = now
        stamps = []
        for path in state_files(self._state_dir):
            try:
                stat = os.stat(path)
            except FileNotFoundError:
                continue
            stamps.append((stat.st_mtime_ns, stat.st_ino))  # a supervisor replaces its file: new inode
        stamp = tuple(stamps)
        if stamp != self._stamp:
            try:
                state = read_state(self._state_dir) if stamps else None
            except (OSError, ValueError, KeyError, TypeError):
                return self._endpoints  # mid-replace on an odd filesystem: keep the last view
            routable = state.routable() if state is not None else []
            self._endpoints = [ReplicaEndpoint(r.url, r.url, frozenset(r.adapters)) for r in routable if r.url]
            self._stamp = stamp
        return self._endpoints


@dataclass
class UpstreamResponse:
    status: int
    content_type: str
    chunks: AsyncIterator[bytes]  # raises BackendTimeout or BackendBrokeOff
    close: Callable[[], Awaitable[None]]


class Backend(Protocol):
    """One replica, as the router sees it."""

    key: str

    async def send(self, path: str, body: bytes) -> UpstreamResponse:
        """POST `body` to `path`; return once the response head has arrived. Raises
        `BackendUnavailable` when nothing was received, `BackendTimeout` when the head did not
        come in time."""
        ...


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 3.0  # a replica that does not accept within this is treated as down
    # Longest silence between two chunks (or before the head of a non-streamed answer, which
    # vLLM sends only when generation is done): long completions on a busy CPU replica are slow.
    read_s: float = 600.0
    # Idle connections to replicas are kept a minute, so a burst that follows a quiet spell finds
    # them open instead of paying a connect per request (as nginx keeps upstream connections).
    # Replicas keep theirs longer (serving.vllm: REPLICA_KEEPALIVE_S), so the router is the side
    # that closes and a reused connection is rarely one the replica is closing.
    keepalive_s: float = 60.0


class HttpClient:
    """The connection pools of a router's replicas, one per replica URL, made on first use: a
    pool belongs to the event loop it was made in, and routers are built before their loop runs."""

    def __init__(self, timeouts: Timeouts) -> None:
        self.timeouts = timeouts
        self._pools: dict[str, ReplicaPool] = {}

    def pool(self, url: str) -> ReplicaPool:
        pool = self._pools.get(url)
        if pool is None or pool.loop is not asyncio.get_running_loop():
            t = self.timeouts
            pool = self._pools[url] = ReplicaPool(
                url, connect_s=t.connect_s, read_s=t.read_s, keepalive_s=t.keepalive_s
            )
        return pool

    async def aclose(self) -> None:
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.close()


class HttpBackend:
    def __init__(self, key: str, url: str, client: HttpClient) -> None:
        self.key = key
        self.url = url.rstrip("/")
        self._client = client

    async def send(self, path: str, body: bytes) -> UpstreamResponse:
        connection = await self._client.pool(self.url).post(path, body)
        exchange = connection.exchange

        async def close() -> None:
            # Closes the connection of a stream cut short (vLLM then aborts the request); a
            # finished answer's connection is already back in the pool.
            connection.abort(exchange)

        # The connection itself iterates the body: one layer per relayed event, not three.
        return UpstreamResponse(
            status=connection.status,
            content_type=connection.content_type or "application/json",
            chunks=connection,
            close=close,
        )


@dataclass(frozen=True)
class TokenUsage:
    prompt_tokens: int
    completion_tokens: int


def usage_of(document: Any) -> TokenUsage | None:
    """The `usage` of an OpenAI response (or stream chunk), if it has a well-formed one."""
    usage = document.get("usage") if isinstance(document, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return TokenUsage(prompt, completion)


@dataclass
class ProxyResponse:
    """What the view sends back: a status, a content type, and either a whole body or a stream
    of bytes to pass through as they come (SSE for `stream: true`)."""

    status: int
    content_type: str
    body: bytes | None = None
    stream: RelayStream | None = None
    replica: str | None = None
    headers: dict[str, str] = field(default_factory=dict)  # more response headers (Retry-After, …)
    whole_usage: TokenUsage | None = None  # a whole answer's usage, read once it arrived

    @property
    def usage(self) -> TokenUsage | None:
        """The tokens the answer used, as the replica reported them: known for a whole answer,
        and for a stream once it ended."""
        return self.stream.usage if self.stream is not None else self.whole_usage

    async def iter_bytes(self) -> AsyncIterator[bytes]:
        """The body as an async generator, for a framework's streaming response (Django's
        `StreamingHttpResponse`). Its `finally` closes the relay, which ends the upstream request
        and frees the routing slot when the client goes away; asyncio's async-generator finalizer
        runs it even if the framework drops the generator without closing it."""
        if self.stream is None:
            yield self.body or b""
            return
        try:
            async for chunk in self.stream:
                yield chunk
        finally:
            await self.stream.aclose()


class UsageTap:
    """Reads the final token usage off a stream of server-sent events as it is relayed.

    vLLM reports a stream's usage only when asked (`stream_options.include_usage`), in one last
    event with no choices; the router always asks, and drops that event again (`strip`) when
    the client did not ask for it. Events are passed on whole: a chunk that ends inside an event
    waits for the rest of it (clients act only on whole events anyway). Most chunks cost two
    byte searches.
    """

    MARK = b'"usage"'

    def __init__(self, *, strip: bool) -> None:
        self.usage: TokenUsage | None = None
        self._strip = strip
        self._carry = b""  # the start of an event whose end has not arrived

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to relay for `chunk` (possibly none yet)."""
        if not self._carry and chunk.endswith(b"\n\n") and self.MARK not in chunk:
            return chunk
        data = self._carry + chunk
        end = data.rfind(b"\n\n") + 2
        whole, self._carry = data[:end], data[end:]
        if self.MARK not in whole:
            return whole
        kept = []
        for event in whole.split(b"\n\n")[:-1]:
            if self.MARK in event and self._read_usage(event) and self._strip:
                continue
            kept.append(event + b"\n\n")
        return b"".join(kept)

    def rest(self) -> bytes:
        """What is left when the stream ends: an event that never ended, passed on as it is."""
        rest, self._carry = self._carry, b""
        return rest

    def _read_usage(self, event: bytes) -> bool:
        """Takes the usage of a `data: {...}` event; True if it is the usage-only event."""
        try:
            document = json.loads(event.removeprefix(b"data:").strip())
        except ValueError:
            return False
        usage = usage_of(document)
        if usage is None:
            return False
        self.usage = usage
        return document.get("choices") == []


def error_response(error: OpenAIError) -> ProxyResponse:
    return ProxyResponse(status=error.status, content_type="application/json", body=error.body_bytes())


class Router:
    """Routing by the deployment's policy, with failover, over one deployment's replicas."""

    def __init__(
        self,
        source: ReplicaSource,
        *,
        model: str,
        backend_factory: Callable[[ReplicaEndpoint], Backend] | None = None,
        timeouts: Timeouts = Timeouts(),
        eject_s: float = 5.0,
        policy: str = DEFAULT_POLICY,
        replica_loads: ReplicaLoads | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self._chooser = chooser(policy)
        self._source = source
        # The replicas' own counts: HTTP replicas are read; scripted backends (tests) report none.
        self._replica_loads = replica_loads or (
            ReplicaLoads(lambda: [e.url for e in source.endpoints()]) if backend_factory is None else None
        )
        self._timeouts = timeouts
        self._http = HttpClient(timeouts)
        self._factory = backend_factory or (lambda e: HttpBackend(e.key, e.url, self._http))
        self._backends: dict[str, Backend] = {}
        self._outstanding: dict[str, int] = {}
        self._ejected_until: dict[str, float] = {}
        # eject_s: after a failed connection, how long this router leaves the replica alone; the
        # supervisor's state file catches up within its probe interval.
        self._eject_s = eject_s

    async def aclose(self) -> None:
        if self._replica_loads is not None:
            await self._replica_loads.aclose()
        await self._http.aclose()

    def outstanding(self) -> dict[str, int]:
        """Requests in flight per replica key (streams count until their last byte)."""
        return {k: v for k, v in self._outstanding.items() if v}

    def adapters(self) -> set[str]:
        """The LoRA adapters some replica serves now: model names besides the router's own."""
        return {name for endpoint in self._source.endpoints() for name in endpoint.adapters}

    def routable(self, model: str | None = None) -> list[Backend]:
        """The replicas that may take a request now; for `model`, those that serve it (all of
        them serve the base model, an adapter only those that loaded it)."""
        now = time.monotonic()
        live = []
        endpoints = self._source.endpoints()
        if len(self._backends) > 2 * len(endpoints) + 8:
            self._forget_gone({e.key for e in endpoints})
        for endpoint in endpoints:
            if self._ejected_until.get(endpoint.key, 0.0) > now:
                continue
            if model is not None and model != self.model and model not in endpoint.adapters:
                continue
            backend = self._backends.get(endpoint.key)
            if backend is None:
                backend = self._backends[endpoint.key] = self._factory(endpoint)
            live.append(backend)
        return live

    def _forget_gone(self, listed: set[str]) -> None:
        """Drop what is kept about replicas no longer listed (a restarted replica comes back on a
        new port, so keys accumulate) once nothing of theirs is in flight."""
        for key in list(self._backends):
            if key not in listed and not self._outstanding.get(key):
                self._backends.pop(key, None)
                self._outstanding.pop(key, None)
                self._ejected_until.pop(key, None)

    def load(self, key: str) -> int:
        """Requests on a replica: this router's in flight, or the replica's own count if larger
        (it includes other web processes' requests)."""
        mine = self._outstanding.get(key, 0)
        return max(mine, self._replica_loads.of(key)) if self._replica_loads is not None else mine

    def pick(
        self, exclude: AbstractSet[str] = frozenset(), model: str | None = None, prefix: str | None = None
    ) -> Backend | None:
        candidates = {b.key: b for b in self.routable(model) if b.key not in exclude}
        if len(candidates) <= 1:  # nothing to choose (and no replica's load to read)
            return next(iter(candidates.values()), None)
        return candidates[self._chooser.choose(list(candidates), self.load, prefix)]

    def _acquire(self, key: str, weight: int) -> None:
        self._outstanding[key] = self._outstanding.get(key, 0) + weight

    def _release(self, key: str, weight: int) -> None:
        self._outstanding[key] = self._outstanding.get(key, weight) - weight

    async def forward(self, path: str, body: dict[str, Any], *, weight: int = 1) -> ProxyResponse:
        """Send a validated request to a replica and return its answer; never raises for
        replica failures (they become OpenAI error responses).

        `weight` is the sequences the request asks for (n samples of each prompt): they count
        as that many requests in flight when the next request picks its replica. A stream is
        always sent with `stream_options.include_usage`, so its token use is known at its end."""
        streaming = bool(body.get("stream"))
        strip_usage = False
        if streaming:
            options = body.get("stream_options")
            options = options if isinstance(options, dict) else {}
            if not options.get("include_usage"):
                strip_usage = True
                body = {**body, "stream_options": {**options, "include_usage": True, "continuous_usage_stats": False}}
        payload = json.dumps(body).encode()
        tried: set[str] = set()
        last_failure = ""
        model = body.get("model")
        model = model if isinstance(model, str) else None
        prefix = prefix_of(path, body) if self.policy == "prefix" else None
        while (backend := self.pick(tried, model, prefix)) is not None:
            tried.add(backend.key)
            self._acquire(backend.key, weight)
            try:
                upstream = await backend.send(path, payload)
            except BackendUnavailable as exc:
                self._release(backend.key, weight)
                self._ejected_until[backend.key] = time.monotonic() + self._eject_s
                last_failure = str(exc)
                log.warning("replica %s unreachable, trying another: %s", backend.key, exc)
                continue
            except BackendTimeout:
                self._release(backend.key, weight)
                return error_response(upstream_timeout(self._timeouts.read_s))
            except BaseException:
                self._release(backend.key, weight)
                raise
            if upstream.status < 400 and streaming:
                return ProxyResponse(
                    upstream.status,
                    upstream.content_type,
                    stream=self._stream(backend.key, weight, upstream, UsageTap(strip=strip_usage)),
                    replica=backend.key,
                )
            return await self._whole(backend.key, weight, upstream)
        if last_failure:
            return error_response(upstream_failed(f"no replica could be reached (last: {last_failure})"))
        if model is not None and model != self.model and model not in (served := self.adapters()):
            # An adapter detached since the gateway looked (the state file changed in between): as
            # any model not served, a 404, not a wait for a replica that will never have it.
            return error_response(model_not_found(model, sorted({self.model, *served})))
        return error_response(no_replica_available(model or self.model))

    def _stream(self, key: str, weight: int, upstream: UpstreamResponse, tap: UsageTap) -> RelayStream:
        return RelayStream(
            upstream, release=lambda: self._release(key, weight), read_timeout_s=self._timeouts.read_s, tap=tap
        )

    async def _whole(self, key: str, weight: int, upstream: UpstreamResponse) -> ProxyResponse:
        """A whole answer (not streamed, or an error), read before it is passed on."""
        try:
            raw = b"".join([chunk async for chunk in upstream.chunks])
        except BackendTimeout:
            return error_response(upstream_timeout(self._timeouts.read_s))
        except BackendBrokeOff as exc:
            return error_response(upstream_failed(f"the response broke off: {exc}"))
        finally:
            await upstream.close()
            self._release(key, weight)
        if upstream.status >= 400:
            return ProxyResponse(
                upstream.status, "application/json", normalize_error_body(upstream.status, raw), replica=key
            )
        try:
            usage = usage_of(json.loads(raw))
        except ValueError:
            usage = None
        return ProxyResponse(upstream.status, upstream.content_type, raw, replica=key, whole_usage=usage)


class RelayStream:
    """A replica's response bytes, passed through as they come. The request counts as outstanding
    until the stream ends or `aclose()` is called; the view must call `aclose()` when it stops
    early (a client that hung up), and it is safe to call it twice or before iterating at all:
    a plain async generator would skip its cleanup when closed before its first item."""

    def __init__(
        self,
        upstream: UpstreamResponse,
        *,
        release: Callable[[], None],
        read_timeout_s: float,
        tap: UsageTap | None = None,
    ) -> None:
        self._upstream = upstream
        self._chunks = upstream.chunks.__aiter__()
        self._release: Callable[[], None] | None = release
        self._read_timeout_s = read_timeout_s
        self._tap = tap
        self._tail: bytes | None = None  # a last piece still to send before closing

    @property
    def usage(self) -> TokenUsage | None:
        return self._tap.usage if self._tap is not None else None

    def __aiter__(self) -> RelayStream:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._release is None:
                raise StopAsyncIteration
            if self._tail is not None:
                tail, self._tail = self._tail, None
                await self.aclose()
                return tail
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                rest = self._tap.rest() if self._tap is not None else b""
                if rest:
                    self._tail = rest
                    continue
                await self.aclose()
                raise
            except asyncio.CancelledError:
                # An ASGI server cancels the response task when the client disconnects.
                await self.aclose()
                raise
            except BackendTimeout:
                self._tail = upstream_timeout(self._read_timeout_s).sse_event()
                continue
            except BackendBrokeOff as exc:
                log.warning("stream from a replica broke off: %s", exc)
                self._tail = upstream_failed(f"the stream broke off: {exc}").sse_event()
                continue
            relayed = self._tap.feed(chunk) if self._tap is not None else chunk
            if relayed:
                return relayed

    async def aclose(self) -> None:
        release, self._release = self._release, None
        if release is None:
            return
        try:
            with contextlib.suppress(Exception):
                await self._upstream.close()
        finally:
            release()
