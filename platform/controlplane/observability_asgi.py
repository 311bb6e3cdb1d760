"""ASGI wrappers that observe the web process's traffic without being part of it.

`observe_http` wraps all HTTP: it gives each request its id (observability_logs) and returns it
as `X-Request-Id`, counts 5xx answers, and, for the OpenAI endpoint under `/v1/`, counts requests,
times them and their first answer byte (time to first token, for streamed answers), and counts
the tokens vLLM reported for the answer, which the /v1 app leaves in the scope (`V1_USAGE`): the
client may not have asked to see them. `count_websockets` keeps the open websocket count.

They sit outside the apps they wrap (controlplane/asgi.py): the /v1 app and its router stay
free of metrics, and what is measured is what the client gets. Per relayed chunk of a stream the
cost is about 0.5 µs (a 20,000-chunk stream: 0.4 µs per chunk bare, 0.9 µs observed), against the
~46 µs per relayed token the web process spends on /v1 (bench.serving).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from channels.db import database_sync_to_async

from controlplane.observability import (
    HTTP_ERRORS,
    V1_DURATION,
    V1_REQUESTS,
    V1_TOKENS,
    V1_TTFT,
    V1_USAGE,
    WEBSOCKET_CLIENTS,
)
from controlplane.observability_logs import REQUEST_ID, request_id_from
from serving.openai_requests import ENDPOINTS

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# Loose on purpose: Django's handler, Channels' router and the /v1 app each type these their way.
App = Callable[[Any, Any, Any], Awaitable[None]]

log = logging.getLogger("fathom.v1")

# The start of an answer searched for its model: the first fields of a body or first event.
HEAD_BYTES = 2048
_MODEL = re.compile(rb'"model"\s*:\s*"([^"\\]{1,200})"')
# How often the served model names are read again when an answer names one not yet known.
NAMES_REFRESH_S = 5.0


def _header(scope: Scope, name: bytes) -> str | None:
    return next((value.decode("latin-1") for key, value in scope.get("headers", []) if key == name), None)


@database_sync_to_async
def _served_model_names() -> frozenset[str]:
    from deployments.models import Deployment

    return frozenset(Deployment.objects.values_list("served_model_name", flat=True))


class DeploymentNames:
    """Served model names that exist. A label only ever carries one of these, so a client that
    sends made-up model names cannot make a series per name."""

    def __init__(self) -> None:
        self._names: frozenset[str] = frozenset()
        self._read_at = -math.inf
        self._reading: asyncio.Task[None] | None = None

    async def known(self, name: str | None) -> str:
        if not name:
            return ""
        if name not in self._names:
            reading = self._reading
            if reading is not None and (reading.done() or reading.get_loop() is not asyncio.get_running_loop()):
                reading = None  # ended, or begun on an event loop that is gone (tests run several)
            if reading is None and time.monotonic() - self._read_at > NAMES_REFRESH_S:
                self._read_at = time.monotonic()
                reading = self._reading = asyncio.ensure_future(self._read())
            if reading is not None:
                # Every answer that names a model not yet known waits for the one read under way
                # (a burst costs one query), not only the answer that began it: the others would
                # be counted under no deployment. Shielded: a request cut short ends no read.
                await asyncio.shield(reading)
        return name if name in self._names else ""

    async def _read(self) -> None:
        try:
            self._names = await _served_model_names()
        except Exception:  # a database hiccup costs a label, never the request
            log.warning("could not read the served model names", exc_info=True)


DEPLOYMENT_NAMES = DeploymentNames()


class _V1Exchange:
    """What one /v1 request and its answer showed, recorded when it ends."""

    def __init__(self, path: str) -> None:
        self.arrived = time.perf_counter()
        self.endpoint = ENDPOINTS.get(path) or ("models" if path == "/v1/models" else "other")
        self.request_body: list[bytes] = []
        self.status = 0
        self.streamed = False
        self.first_byte_at: float | None = None
        self.head = b""
        self.usage: list[tuple[int, int]] = []  # V1_USAGE

    def response_started(self, message: Message) -> None:
        self.status = int(message["status"])
        content_type = next((v for k, v in message.get("headers", []) if k.lower() == b"content-type"), b"")
        self.streamed = content_type.startswith(b"text/event-stream")

    def body_sent(self, body: bytes) -> None:
        if not body:
            return
        if self.first_byte_at is None:
            self.first_byte_at = time.perf_counter()
            self.head = body[:HEAD_BYTES]

    async def record(self, failed: bool) -> dict[str, Any]:
        """Counts the exchange; returns what the log line says about it."""
        named = _MODEL.search(self.head)
        if named is None and self.request_body:
            named = _MODEL.search(b"".join(self.request_body))
        deployment = await DEPLOYMENT_NAMES.known(named.group(1).decode() if named else None)
        status = str(self.status) if self.status and not failed else "500"
        now = time.perf_counter()
        V1_REQUESTS.labels(deployment, self.endpoint, status).inc()
        V1_DURATION.labels(deployment, self.endpoint).observe(now - self.arrived)
        facts: dict[str, Any] = {"deployment": deployment, "endpoint": self.endpoint, "status": int(status),
                                 "duration_s": round(now - self.arrived, 4)}  # fmt: skip
        if self.streamed and self.status == 200 and self.first_byte_at is not None:
            V1_TTFT.labels(deployment).observe(self.first_byte_at - self.arrived)
            facts["ttft_s"] = round(self.first_byte_at - self.arrived, 4)
        if self.status == 200 and self.usage:
            prompt_tokens, completion_tokens = self.usage[-1]
            V1_TOKENS.labels(deployment, "prompt").inc(prompt_tokens)
            V1_TOKENS.labels(deployment, "completion").inc(completion_tokens)
            facts.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
        return facts


def observe_http(app: App) -> App:
    """Wraps the HTTP app (asgi.py's http_application)."""

    async def observed(scope: Scope, receive: Receive, send: Send) -> None:
        request_id = request_id_from(_header(scope, b"x-request-id"))
        reset = REQUEST_ID.set(request_id)
        path = scope["path"]
        exchange = _V1Exchange(path) if path.startswith("/v1/") else None
        if exchange is not None:
            scope[V1_USAGE] = exchange.usage
        status = 0

        async def observed_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
                if exchange is not None:
                    exchange.response_started(message)
            elif message["type"] == "http.response.body" and exchange is not None:
                exchange.body_sent(message.get("body", b""))
            await send(message)

        async def observed_receive() -> Message:
            message = await receive()
            if exchange is not None and message["type"] == "http.request":
                exchange.request_body.append(message.get("body", b""))
            return message

        failed = False
        try:
            await app(scope, observed_receive, observed_send)
        except Exception:
            failed = True  # uvicorn answers 500 (or cuts a started answer) and logs the error
            raise
        finally:
            where = "v1" if exchange is not None else "web"
            if failed or status >= 500:
                HTTP_ERRORS.labels(where, str(status) if status and not failed else "500").inc()
            if exchange is not None:
                facts = await exchange.record(failed)
                log.info("%s %s %s %s %.3f s", scope["method"], path, facts["status"], facts["deployment"] or "-",
                         facts["duration_s"], extra=facts)  # fmt: skip
            REQUEST_ID.reset(reset)

    return observed


def _stream(path: str) -> str:
    for stream in ("runs", "deployments"):
        if path.startswith(f"/ws/{stream}/"):
            return stream
    return "other"


def count_websockets(app: App) -> App:
    """Wraps the websocket app: a connection counts from its accept until the app returns."""

    async def counted(scope: Scope, receive: Receive, send: Send) -> None:
        clients = WEBSOCKET_CLIENTS.labels(_stream(scope["path"]))
        accepted = False

        async def counted_send(message: Message) -> None:
            nonlocal accepted
            await send(message)
            if message["type"] == "websocket.accept" and not accepted:
                accepted = True
                clients.inc()

        try:
            await app(scope, receive, counted_send)
        finally:
            if accepted:
                clients.dec()

    return counted
