"""The router's HTTP/1.1 hop to replicas: a keep-alive connection pool whose connections parse
their answers with httptools and hand the body to the relay as it arrives.

Why not a general client: relaying a token's SSE event is nearly all the router's work, and
aiohttp (the client it used before) spent about 45% of a relay's CPU on its own reading path
(cProfile of a standalone router relaying bursts of 100 streams from a scripted replica): per
event, a protocol callback, a stream reader with its waiters and flow control, and three
iterator layers. Here an event costs one C parser call (`on_body`), one wakeup and one
`__anext__`; uvicorn reads its requests the same way. What a replica hop needs
and no more: POST with a JSON body, one request per connection at a time, chunked or sized
answers, keep-alive with one retry when a pooled connection turns out closed, a connect
timeout, a read timeout (the longest silence), and read back-pressure.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from typing import cast
from urllib.parse import urlsplit

import httptools

# Not a loss of data: the relay stops reading a stream whose client is slow; once this much
# waits unread, the replica is told to wait too (TCP back-pressure) instead of memory growing.
READ_BUFFER_BYTES = 256 * 1024


class BackendUnavailable(Exception):
    """The replica could not be reached, or dropped the connection before answering."""


class BackendTimeout(Exception):
    """The replica stayed silent longer than the read timeout."""


class BackendBrokeOff(Exception):
    """The response broke off after its head arrived."""


class _PooledConnectionClosed(BackendUnavailable):
    """A kept-alive connection closed before answering: the replica may have closed it just as it
    was reused, so a fresh connection is tried once before the replica counts as unreachable."""


class ReplicaConnection(asyncio.Protocol):
    """One connection to a replica, carrying one exchange at a time. Between `request()` and
    the end of the body it is an async iterator over the body's chunks (chunked framing removed;
    whatever arrived since the last read, joined)."""

    def __init__(self, pool: ReplicaPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.exchange = 0  # which exchange on this connection is under way (from 2 on, a reused one)
        self.status = 0
        self.content_type = ""
        self._head: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._complete = False
        self._keep_alive = False
        self._error: Exception | None = None
        self._last_data_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol -----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is one, unregistered
        sock = transport.get_extra_info("socket")
        if sock is not None:  # each event is a small write the client waits for
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        self._last_data_at = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            # Before the head nothing was generated for the client: another replica may answer.
            broken = BackendBrokeOff if self._head is not None and self._head.done() else BackendUnavailable
            self._fail(broken(f"{self._pool.address}: not an HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._head is not None and not self._complete:
            why = f" ({exc!r})" if exc else ""
            if not self._head.done():
                closed = _PooledConnectionClosed if self.exchange > 1 else BackendUnavailable
                self._fail(closed(f"{self._pool.address}: closed before answering{why}"))
            else:
                self._fail(BackendBrokeOff(f"{self._pool.address}: closed mid-answer{why}"))

    # --- httptools callbacks ----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.content_type = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > READ_BUFFER_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        # Read here: once the callback returns, the parser is reset for the next answer.
        self._keep_alive = self._parser.should_keep_alive()
        self._complete = True
        self._disarm_timer()  # all of it is here: a reader slow to take it is no silent replica
        self._wake()

    # --- the exchange -----------------------------------------------------------------------

    async def request(self, path: str, body: bytes) -> None:
        """POST `body` (JSON) to `path`; returns once the answer's head arrived (`status`,
        `content_type`)."""
        assert self._transport is not None
        self.exchange += 1
        self._head = self._loop.create_future()
        self._chunks.clear()
        self._buffered, self._complete, self._error = 0, False, None
        self.status, self.content_type = 0, ""
        self._transport.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), self._pool.host_header, len(body), body)
        )
        self._last_data_at = self._loop.time()
        self._arm_timer()
        try:
            await self._head
        except BaseException:  # cancelled (its client hung up): the answer will never be read
            self.close()
            raise
        if self._error is not None:
            raise self._error

    def __aiter__(self) -> ReplicaConnection:
        return self

    async def __anext__(self) -> bytes:
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                self._finished()
                raise StopAsyncIteration
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        chunk = self._chunks.popleft() if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._last_data_at = self._loop.time()  # the silence while paused was the reader's
            self._transport.resume_reading()
        return chunk

    def abort(self, exchange: int) -> None:
        """Ends `exchange` early (a client hung up): the connection closes, and a replica aborts
        a request whose connection closed. Harmless once that exchange's body was read whole,
        when the connection may already carry the next one."""
        if exchange == self.exchange and self._head is not None:
            self.close()

    def _finished(self) -> None:
        """The whole answer was read: back to the pool if both sides keep the connection."""
        self._head = None
        self._disarm_timer()
        if self._keep_alive and not self.closed:
            self._pool.release(self)
        else:
            self.close()

    def _fail(self, error: Exception) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_result(None)
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def close(self) -> None:
        self._disarm_timer()
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    # The read timeout costs one timer per exchange, not one per event: `data_received` only
    # notes the time, and the timer, when it fires, sleeps again for the silence still allowed.

    def _arm_timer(self) -> None:
        self._disarm_timer()
        self._timer = self._loop.call_at(self._last_data_at + self._pool.read_s, self._check_silence)

    def _disarm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_silence(self) -> None:
        self._timer = None
        if self._head is None:
            return
        deadline = self._last_data_at + self._pool.read_s
        if self._paused:  # a paused stream waits on its reader, not on the replica
            self._timer = self._loop.call_later(1.0, self._check_silence)
        elif self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._check_silence)
        else:
            self._fail(BackendTimeout(f"{self._pool.address}: no answer in {self._pool.read_s:g} s"))


class ReplicaPool:
    """Connections to one replica, kept open between requests (newest reused first) until they
    have been idle `keepalive_s`; one event loop's."""

    def __init__(self, url: str, *, connect_s: float, read_s: float, keepalive_s: float) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"a replica URL is http://host:port, not {url!r}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.address = f"{self.host}:{self.port}"
        self.host_header = parts.netloc.encode()
        self.connect_s, self.read_s, self.keepalive_s = connect_s, read_s, keepalive_s
        self.loop = asyncio.get_running_loop()
        self._idle: list[ReplicaConnection] = []

    async def post(self, path: str, body: bytes) -> ReplicaConnection:
        """Sends the request on a pooled connection (once more on a new one if the pooled one was
        closed by the replica meanwhile); returns the connection once the answer's head is in.
        Raises `BackendUnavailable` or `BackendTimeout`."""
        connection = self._pooled()
        if connection is not None:
            try:
                await connection.request(path, body)
                return connection
            except _PooledConnectionClosed:
                pass
        connection = await self._connect()
        await connection.request(path, body)
        return connection

    def release(self, connection: ReplicaConnection) -> None:
        connection.idle_since = time.monotonic()
        self._idle.append(connection)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _pooled(self) -> ReplicaConnection | None:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < self.keepalive_s:
                return connection
            connection.close()
        return None

    async def _connect(self) -> ReplicaConnection:
        try:
            async with asyncio.timeout(self.connect_s):
                _, connection = await self.loop.create_connection(lambda: ReplicaConnection(self), self.host, self.port)
        except TimeoutError as exc:
            raise BackendUnavailable(f"{self.address}: no connection in {self.connect_s:g} s") from exc
        except OSError as exc:
            raise BackendUnavailable(f"{self.address}: {exc}") from exc
        return connection
