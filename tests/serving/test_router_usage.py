"""What the router learns from and changes in a relayed answer: the token usage of every answer
(streams included, asked for or not), and the weight of a request for n samples.

Backends here are scripted (the `Backend` interface) so that a stream can be cut at any byte;
real vLLM streams through the router in tests/platform/test_v1_served.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from serving.router import Backend, ReplicaEndpoint, Router, StaticReplicas, UpstreamResponse, UsageTap

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":" the"}}]}\n\n'
USAGE_EVENT = b'data: {"choices":[],"usage":{"prompt_tokens":8,"completion_tokens":4,"total_tokens":12}}\n\n'
DONE = b"data: [DONE]\n\n"


class RecordingBackend:
    """Answers every request with `pieces` (bytes as they would arrive), recording the bodies;
    holds each answer until `release` is set."""

    def __init__(self, key: str, pieces: list[bytes], *, status: int = 200, hold: bool = False) -> None:
        self.key = key
        self.pieces = pieces
        self.status = status
        self.release = asyncio.Event()
        if not hold:
            self.release.set()
        self.bodies: list[dict] = []

    async def send(self, path: str, body: bytes) -> UpstreamResponse:
        self.bodies.append(json.loads(body))

        async def chunks() -> AsyncIterator[bytes]:
            await self.release.wait()
            for piece in self.pieces:
                yield piece

        async def close() -> None:
            return None

        return UpstreamResponse(self.status, "text/event-stream", chunks(), close)


def router_over(*backends: RecordingBackend) -> Router:
    by_key = {b.key: b for b in backends}

    def factory(endpoint: ReplicaEndpoint) -> Backend:
        return by_key[endpoint.key]

    return Router(StaticReplicas(tuple(by_key)), model="tiny", backend_factory=factory)


async def relayed(router: Router, body: dict) -> tuple[bytes, object]:
    response = await router.forward("/v1/chat/completions", body)
    assert response.stream is not None
    data = b"".join([chunk async for chunk in response.stream])
    return data, response.usage


async def test_a_stream_that_did_not_ask_for_usage_is_measured_and_relayed_without_it() -> None:
    replica = RecordingBackend("a", [CHUNK, CHUNK, USAGE_EVENT, DONE])
    data, usage = await relayed(router_over(replica), {"model": "tiny", "stream": True})
    assert replica.bodies[0]["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    assert data == CHUNK + CHUNK + DONE
    assert (usage.prompt_tokens, usage.completion_tokens) == (8, 4)


async def test_a_stream_that_asked_for_usage_gets_it_unchanged() -> None:
    replica = RecordingBackend("a", [CHUNK, USAGE_EVENT, DONE])
    body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True}}
    data, usage = await relayed(router_over(replica), body)
    assert replica.bodies[0]["stream_options"] == {"include_usage": True}
    assert data == CHUNK + USAGE_EVENT + DONE
    assert usage.completion_tokens == 4


async def test_events_cut_anywhere_by_the_network_are_relayed_whole_and_the_same() -> None:
    whole = CHUNK + CHUNK + USAGE_EVENT + DONE
    for cut in range(1, len(whole)):
        replica = RecordingBackend("a", [whole[:cut], whole[cut:]])
        data, usage = await relayed(router_over(replica), {"model": "tiny", "stream": True})
        assert data == CHUNK + CHUNK + DONE, cut
        assert usage is not None and usage.completion_tokens == 4, cut


def test_content_that_mentions_usage_is_not_taken_for_the_usage_event() -> None:
    tap = UsageTap(strip=True)
    event = b'data: {"choices":[{"index":0,"delta":{"content":"\\"usage\\": {}"}}]}\n\n'
    assert tap.feed(event) == event
    assert tap.usage is None


async def test_a_whole_answer_reports_its_usage() -> None:
    answer = json.dumps({"choices": [{"index": 0}], "usage": {"prompt_tokens": 5, "completion_tokens": 7}}).encode()
    replica = RecordingBackend("a", [answer])
    response = await router_over(replica).forward("/v1/chat/completions", {"model": "tiny"})
    assert response.body == answer
    assert "stream_options" not in replica.bodies[0]
    assert response.usage is not None and (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 7)


async def test_a_request_for_n_samples_weighs_n_in_the_choice_of_replica() -> None:
    a, b = RecordingBackend("a", [CHUNK, DONE], hold=True), RecordingBackend("b", [CHUNK, DONE], hold=True)
    router = router_over(a, b)
    first = await router.forward("/v1/chat/completions", {"model": "tiny", "stream": True, "n": 3}, weight=3)
    assert first.replica == "a" and router.outstanding() == {"a": 3}
    # Three single requests all fit under the three samples already on a.
    singles = [await router.forward("/v1/chat/completions", {"model": "tiny", "stream": True}) for _ in range(3)]
    assert [s.replica for s in singles] == ["b", "b", "b"]
    a.release.set()
    b.release.set()
    for response in [first, *singles]:
        assert response.stream is not None
        await response.stream.aclose()
    assert router.outstanding() == {}
