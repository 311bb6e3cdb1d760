"""The router's HTTP hop to replicas (serving.replica_http) against real TCP servers on loopback
that answer as scripted: keep-alive, a connection the replica closed while pooled, silence past
the read timeout, an answer cut short, a client that leaves, and a reader slower than the replica.
What is asserted is what the router's client gets. Real vLLM behind it: test_deployment.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

from serving.router import Router, StaticReplicas, Timeouts

SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
STREAM = {"model": "tiny", "prompt": "hi", "stream": True}


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def event(n: int) -> bytes:
    return b'data: {"choices": [{"text": "%d"}]}\n\n' % n


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    """One request's body, or None once the client closed the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")
    )
    return await reader.readexactly(length)


class Replica:
    """A loopback server whose `answer(number, reader, writer)` plays each request on a
    connection (`number` counts the requests of that connection from 1); it counts connections."""

    def __init__(self, answer: Callable[[int, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.answer = answer
        self.connections = 0
        self.closed_by_client = 0
        self.requests: list[dict] = []

    async def __aenter__(self) -> Replica:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = 0
        try:
            while (body := await read_request(reader)) is not None:
                number += 1
                self.requests.append(json.loads(body))
                if not await self.answer(number, reader, writer):
                    break  # the script closes the connection
            else:
                self.closed_by_client += 1
        except ConnectionError:  # while answering
            self.closed_by_client += 1
        finally:
            writer.close()


async def streams_events(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    writer.write(SSE_HEAD + b"".join(chunk(event(i)) for i in range(3)) + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    return True


def router_to(replica: Replica, **timeouts: float) -> Router:
    return Router(StaticReplicas((replica.url,)), model="tiny", timeouts=Timeouts(**timeouts))


async def relayed(router: Router, body: dict | None = None) -> tuple[int, bytes]:
    response = await router.forward("/v1/completions", body or STREAM)
    if response.stream is None:
        return response.status, response.body or b""
    return response.status, b"".join([piece async for piece in response.stream])


async def test_requests_one_after_another_share_one_connection_and_concurrent_streams_each_have_one() -> None:
    async with Replica(streams_events) as replica:
        router = router_to(replica)
        for _ in range(3):
            assert await relayed(router) == (200, b"".join(event(i) for i in range(3)) + b"data: [DONE]\n\n")
        assert replica.connections == 1
        answers = await asyncio.gather(*(relayed(router) for _ in range(4)))
        assert {status for status, _ in answers} == {200} and len({body for _, body in answers}) == 1
        assert replica.connections == 4  # the first one again, and three more
        await router.aclose()


async def test_a_pooled_connection_the_replica_closed_as_it_was_reused_costs_the_client_nothing() -> None:
    """The replica takes a second request on a kept connection and closes it unanswered (as a
    server does whose keep-alive ran out just then): the request goes again on a new connection."""

    async def closes_on_reuse(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        return number == 1 and await streams_events(number, reader, writer)

    async with Replica(closes_on_reuse) as replica:
        router = router_to(replica)
        first, second = await relayed(router), await relayed(router)
        assert first == second and first[0] == 200
        assert replica.connections == 2 and len(replica.requests) == 3  # the lost one, then its resend
        await router.aclose()


async def test_a_replica_silent_past_the_read_timeout_gets_a_504_or_an_error_event_after_what_it_sent() -> None:
    async def silent_before_the_head(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await reader.read()  # until the client leaves
        return False

    async def silent_after_one_event(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD + chunk(event(0)))
        await reader.read()
        return False

    async with Replica(silent_before_the_head) as replica:
        router = router_to(replica, read_s=0.5)
        started = time.monotonic()
        status, body = await relayed(router)
        assert status == 504 and json.loads(body)["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - started < 5
        await router.aclose()
    async with Replica(silent_after_one_event) as replica:
        router = router_to(replica, read_s=0.5)
        status, body = await relayed(router)
        first, error = body.split(b"\n\n")[:2]
        assert status == 200 and first + b"\n\n" == event(0)
        assert json.loads(error.removeprefix(b"data: "))["error"]["code"] == "upstream_timeout"
        await router.aclose()


async def test_an_answer_the_replica_cuts_short_ends_with_an_error_event_after_what_it_sent() -> None:
    async def cuts_after_two_events(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD + chunk(event(0)) + chunk(event(1)))
        await writer.drain()
        return False

    async with Replica(cuts_after_two_events) as replica:
        router = router_to(replica)
        status, body = await relayed(router)
        assert status == 200 and body.startswith(event(0) + event(1))
        error_event = body.removeprefix(event(0) + event(1)).split(b"\n\n")[0]
        error = json.loads(error_event.removeprefix(b"data: "))["error"]
        assert error["code"] == "upstream_error" and "broke off" in error["message"]
        await router.aclose()


async def test_a_stream_its_client_leaves_closes_the_connection_so_the_replica_stops() -> None:
    async def streams_until_stopped(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD)
        for i in range(1000):
            writer.write(chunk(event(i)))
            await writer.drain()
            await asyncio.sleep(0.01)
        return True

    async with Replica(streams_until_stopped) as replica:
        router = router_to(replica)
        response = await router.forward("/v1/completions", STREAM)
        assert response.stream is not None
        assert await response.stream.__anext__() == event(0)
        await response.stream.aclose()
        deadline = time.monotonic() + 5
        while not replica.closed_by_client and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert replica.closed_by_client == 1 and router.outstanding() == {}
        await router.aclose()


async def test_a_reader_slower_than_the_replica_holds_it_back_and_loses_nothing() -> None:
    """32 MiB, more than the sockets' buffers hold: the replica finishes writing only after the
    reader has read most of it (the router stopped reading meanwhile), and every byte arrives."""
    piece = b"data: " + b"x" * 65_000 + b"\n\n"
    pieces = 32 * 1024 * 1024 // len(piece)
    written_at: list[float] = []

    async def streams_fast(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(SSE_HEAD)
        for _ in range(pieces):
            writer.write(chunk(piece))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        written_at.append(time.monotonic())
        return True

    async with Replica(streams_fast) as replica:
        router = router_to(replica)
        response = await router.forward("/v1/completions", STREAM)
        assert response.stream is not None
        await asyncio.sleep(1.0)  # a client that is slow to start reading
        reading_from = time.monotonic()
        received = b"".join([part async for part in response.stream])
        assert received == piece * pieces
        assert written_at and written_at[0] > reading_from
        await router.aclose()


async def test_a_whole_answer_with_a_content_length_is_passed_on_and_its_connection_kept() -> None:
    answer = json.dumps(
        {"choices": [{"text": "a dog"}], "usage": {"prompt_tokens": 2, "completion_tokens": 2}}
    ).encode()

    async def answers_whole(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
        )
        await writer.drain()
        return True

    async with Replica(answers_whole) as replica:
        router = router_to(replica)
        for _ in range(2):
            response = await router.forward("/v1/completions", {"model": "tiny", "prompt": "hi"})
            assert (response.status, response.content_type, response.body) == (200, "application/json", answer)
            assert response.usage is not None and response.usage.completion_tokens == 2
        assert replica.connections == 1
        await router.aclose()


async def test_a_replica_that_answers_something_not_http_is_failed_over_like_a_refused_one() -> None:
    async def answers_garbage(number: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        return False

    async with Replica(answers_garbage) as garbage, Replica(streams_events) as healthy:
        router = Router(StaticReplicas((garbage.url, healthy.url)), model="tiny")
        answers = [await relayed(router) for _ in range(3)]
        assert all(status == 200 for status, _ in answers)
        assert len(healthy.requests) == 3  # after the garbage, the router leaves that replica alone
        await router.aclose()


async def test_a_whole_answer_left_unread_past_the_read_timeout_is_still_read_whole() -> None:
    """The replica finished answering; the reader comes back later than the read timeout: the
    replica was not silent, so nothing of its answer is lost to a timeout."""
    async with Replica(streams_events) as replica:
        router = router_to(replica, read_s=0.3)
        response = await router.forward("/v1/completions", STREAM)
        assert response.stream is not None
        await asyncio.sleep(1.0)
        body = b"".join([piece async for piece in response.stream])
        assert body == b"".join(event(i) for i in range(3)) + b"data: [DONE]\n\n"
        await router.aclose()
