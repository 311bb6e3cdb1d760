"""bench.serving's client: streamed completions, each on a new connection, read event by event.

The client shares its core with the relays it measures (bench.serving, Placement), so every
millisecond of CPU it spends is one the routed ways lose and the direct way does not: a user's
own client runs on the user's machine. It is therefore as lean as a correct client can be. Each
request is an `asyncio.Protocol` on uvloop: its bytes are ready before the load starts, httptools
parses the answer (status, chunked transfer encoding) in C, and every server-sent event is parsed
as JSON, as a chat client does, to find the first token and the usage. In bench.serving on one
machine (2026-12-04) aiohttp, which it replaced, spent 270-310 ms of CPU per burst of 100 chats of
64 tokens, and this client 170-240 ms.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit

import httptools


@dataclass(frozen=True)
class Stream:
    """What one streamed completion showed its client."""

    ttft_s: float  # from the connect to the first event carrying text
    tokens: int  # output tokens, as the answer's usage reports them


def request_bytes(url: str, body: dict[str, object], key: str = "") -> bytes:
    """The whole HTTP/1.1 request that POSTs `body` to `url`, closing the connection after."""
    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = (
        f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\nConnection: close\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + "\r\n"
    )
    return head.encode() + payload


class _StreamedAnswer(asyncio.Protocol):
    """One request on its own connection: sends it once connected, then reads its events."""

    def __init__(self, request: bytes, chat: bool, started: float, done: asyncio.Future[Stream]) -> None:
        self._request = request
        self._chat = chat
        self._started = started
        self._done = done
        self._parser = httptools.HttpResponseParser(self)
        self._pending = b""  # the start of an event whose end has not arrived
        self._ttft = float("nan")
        self._tokens = 0
        self._status = 0
        self._error = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        cast(asyncio.Transport, transport).write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(ConnectionError(f"not an HTTP answer: {error}"))

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self._status != 200:
            self._error += body
            return
        *events, self._pending = (self._pending + body).split(b"\n\n")
        for event in events:
            self._event(event)

    def _event(self, event: bytes) -> None:
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            return
        data = json.loads(event[6:])
        if self._ttft != self._ttft and data.get("choices"):
            choice = data["choices"][0]
            if choice.get("delta", {}).get("content") if self._chat else choice.get("text"):
                self._ttft = time.perf_counter() - self._started
        if data.get("usage"):
            self._tokens = data["usage"]["completion_tokens"]

    def on_message_complete(self) -> None:
        if self._status != 200:
            self._fail(ConnectionError(f"HTTP {self._status}: {self._error[:500]!r}"))
        elif not self._done.done():
            self._done.set_result(Stream(self._ttft, self._tokens))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError(f"the connection closed before the answer ended ({exc})"))

    def _fail(self, error: Exception) -> None:
        if not self._done.done():
            self._done.set_exception(error)


async def stream(url: str, request: bytes, *, chat: bool) -> Stream:
    """Send one prepared request (`request_bytes`) on a new connection and read its streamed answer."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    done: asyncio.Future[Stream] = loop.create_future()
    started = time.perf_counter()
    transport, _ = await loop.create_connection(
        lambda: _StreamedAnswer(request, chat, started, done), parts.hostname or "127.0.0.1", parts.port or 80
    )
    try:
        return await asyncio.wait_for(done, 600)
    finally:
        transport.close()
