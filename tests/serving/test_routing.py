"""The routing policies' choices (serving.routing) over scripted replicas, and the replicas'
own load read off a real HTTP `/metrics`. Real vLLM replicas routed by prefix:
tests/serving/test_deployment.py."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.router import ReplicaEndpoint, Router, StaticReplicas
from serving.routing import LOAD_BOUND, PREFIX_CHARS, PrefixAffinity, ReplicaLoads, chooser, prefix_of, requests_in
from tests.serving.test_router_choice import ScriptedBackend, drain

SYSTEM = "You are the support assistant of a bakery. " * 20  # a long shared system prompt


def chat(system: str, user: str) -> dict:
    return {"stream": True, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def routers(keys: list[str], policy: str = "prefix") -> tuple[Router, dict[str, ScriptedBackend]]:
    backends = {key: ScriptedBackend(key) for key in keys}
    router = Router(StaticReplicas(tuple(keys)), model="tiny", backend_factory=lambda e: backends[e.key], policy=policy)
    return router, backends


def test_the_prefix_is_the_prompts_start_or_the_chats_first_turns() -> None:
    assert prefix_of("/v1/completions", {"prompt": "x" * 2000}) == "x" * PREFIX_CHARS
    assert prefix_of("/v1/completions", {"prompt": ["first", "second"]}) == "first"
    assert prefix_of("/v1/completions", {"prompt": [1, 2, 3]}) == "1,2,3"
    assert prefix_of("/v1/completions", {"prompt": ""}) is None
    long_system = prefix_of("/v1/chat/completions", chat(SYSTEM, "hello"))
    assert long_system == f"system\n{SYSTEM}"[:PREFIX_CHARS]
    assert long_system == prefix_of("/v1/chat/completions", chat(SYSTEM, "another question"))  # shared system prompt
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_of("/v1/chat/completions", parts) == "user\nhi\n"


async def test_requests_that_share_a_prefix_go_to_one_replica_in_every_process_and_spill_when_it_is_loaded() -> None:
    keys = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    first, first_backends = routers(keys)
    second, _ = routers(list(reversed(keys)))  # another web process, which lists them in another order
    for backend in first_backends.values():
        backend.release.set()
    # One at a time (each answered before the next): all on one replica, the same in both processes.
    chosen = set()
    for i in range(6):
        answer = await first.forward("/v1/chat/completions", chat(SYSTEM, f"question {i}"))
        chosen.add(answer.replica)
        await drain(answer.stream)
    assert len(chosen) == 1
    (home,) = chosen
    assert second.pick(prefix=prefix_of("/v1/chat/completions", chat(SYSTEM, "q"))).key == home  # type: ignore[union-attr]

    # Held in flight: the home replica takes requests while within the bound, then they spill.
    for backend in first_backends.values():
        backend.release.clear()
    held = [await first.forward("/v1/chat/completions", chat(SYSTEM, f"held {i}")) for i in range(6)]
    placed = Counter(answer.replica for answer in held)
    assert placed[home] == max(placed.values()) < 6
    assert max(placed.values()) <= -(-LOAD_BOUND * 6 // 3)  # no replica over the bound
    for backend in first_backends.values():
        backend.release.set()
    await asyncio.gather(*(drain(answer.stream) for answer in held))
    await first.aclose()
    await second.aclose()


def test_prefixes_spread_over_the_replicas_and_a_new_replica_moves_only_its_share() -> None:
    policy = PrefixAffinity()
    three = ["a", "b", "c"]
    prompts = [f"conversation {i}: hello" for i in range(600)]
    idle = lambda key: 0  # noqa: E731
    before = {p: policy.choose(three, idle, p) for p in prompts}
    assert all(150 <= n <= 250 for n in Counter(before.values()).values()), Counter(before.values())
    after = {p: policy.choose([*three, "d"], idle, p) for p in prompts}
    moved = [p for p in prompts if after[p] != before[p]]
    assert all(after[p] == "d" for p in moved)  # only to the new replica
    assert 90 <= len(moved) <= 210  # about a quarter


def test_least_loaded_and_round_robin() -> None:
    loads = {"a": 3, "b": 1, "c": 1}
    least = chooser("least_loaded")
    assert [least.choose(["a", "b", "c"], loads.__getitem__, "x") for _ in range(4)] == ["b", "c", "b", "c"]
    turns = chooser("round_robin")
    assert [turns.choose(["a", "b", "c"], loads.__getitem__, "x") for _ in range(4)] == ["a", "b", "c", "a"]
    with pytest.raises(ValueError, match="prefix, least_loaded, round_robin"):
        chooser("random")


class Metrics(BaseHTTPRequestHandler):
    running = 2

    def do_GET(self) -> None:
        body = (
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            f'vllm:num_requests_running{{engine="0",model_name="tiny"}} {Metrics.running}.0\n'
            'vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0\n'
            'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 9.0\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


async def test_a_replicas_own_running_and_waiting_requests_count_in_its_load() -> None:
    assert requests_in(b'vllm:num_requests_running{a="b"} 4.0\nvllm:num_requests_waiting{a="b"} 1.0\n') == 5
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    loads = ReplicaLoads(lambda: [url], interval_s=0.1)
    try:
        assert loads.of(url) == 0  # the first request starts the reading
        for _ in range(50):
            await asyncio.sleep(0.05)
            if loads.of(url) == 5:
                break
        assert loads.of(url) == 5  # running 2 + waiting 3; other gauges not counted
        Metrics.running = 0
        await asyncio.sleep(0.4)
        assert loads.of(url) == 3
        backend = ScriptedBackend(url)
        router = Router(
            StaticReplicas((url,)), model="tiny", backend_factory=lambda e: backend, replica_loads=loads
        )
        assert router.load(url) == 3  # the replica's count, larger than this router's none
    finally:
        await loads.aclose()
        server.shutdown()


def test_a_router_over_real_replicas_reads_their_loads_and_a_scripted_one_does_not() -> None:
    assert Router(StaticReplicas(("http://127.0.0.1:1",)), model="tiny")._replica_loads is not None
    endpoint = ReplicaEndpoint("k", "u")
    assert Router(StaticReplicas(("k",)), model="tiny", backend_factory=lambda e: ScriptedBackend(endpoint.key))._replica_loads is None
