"""The router's choice and failover, over scripted backends (the `Backend` interface) and over a
real port that refuses connections. Real vLLM behind the router: test_deployment.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

from serving.gateway import Gateway
from serving.openai_requests import ServedModel
from serving.router import (
    Backend,
    BackendUnavailable,
    ReplicaEndpoint,
    Router,
    StateFileReplicas,
    StaticReplicas,
    UpstreamResponse,
)
from serving.state import DeploymentDir, DeploymentState, Phase, ReplicaState, read_state, write_state
from tests.ports import free_port


class ScriptedBackend:
    """Answers from a script: refuse, or stream `chunks` after waiting for `release`."""

    def __init__(self, key: str, *, refuse: bool = False) -> None:
        self.key = key
        self.refuse = refuse
        self.release = asyncio.Event()
        self.requests: list[bytes] = []

    async def send(self, path: str, body: bytes) -> UpstreamResponse:
        if self.refuse:
            raise BackendUnavailable(f"{self.key} refused")
        self.requests.append(body)

        async def chunks() -> AsyncIterator[bytes]:
            await self.release.wait()
            yield f'data: {{"replica": "{self.key}"}}\n\n'.encode()
            yield b"data: [DONE]\n\n"

        async def close() -> None:
            return None

        return UpstreamResponse(200, "text/event-stream", chunks(), close)


def router_over(*backends: ScriptedBackend) -> Router:
    by_key = {b.key: b for b in backends}

    def factory(endpoint: ReplicaEndpoint) -> Backend:
        return by_key[endpoint.key]

    return Router(StaticReplicas(tuple(by_key)), model="tiny", backend_factory=factory)


async def drain(stream: AsyncIterator[bytes] | None) -> bytes:
    assert stream is not None
    return b"".join([chunk async for chunk in stream])


async def test_it_sends_each_request_to_the_replica_with_fewest_outstanding() -> None:
    a, b, c = ScriptedBackend("a"), ScriptedBackend("b"), ScriptedBackend("c")
    router = router_over(a, b, c)
    streams = [await router.forward("/v1/completions", {"stream": True}) for _ in range(6)]
    assert router.outstanding() == {"a": 2, "b": 2, "c": 2}
    # Finish b's two streams: the next two requests both go to b.
    b.release.set()
    for response in streams:
        if response.replica == "b":
            await drain(response.stream)
    assert router.outstanding() == {"a": 2, "c": 2}
    nxt = [await router.forward("/v1/completions", {"stream": True}) for _ in range(2)]
    assert [r.replica for r in nxt] == ["b", "b"]
    a.release.set()
    c.release.set()
    for response in streams + nxt:
        if response.replica != "b" or response in nxt:
            await drain(response.stream)
    assert router.outstanding() == {}
    await router.aclose()


async def test_a_stream_the_client_abandons_stops_counting_as_outstanding() -> None:
    a = ScriptedBackend("a")
    router = router_over(a)
    response = await router.forward("/v1/completions", {"stream": True})
    assert router.outstanding() == {"a": 1}
    await response.stream.aclose()  # type: ignore[union-attr]
    assert router.outstanding() == {}


async def test_a_client_that_hangs_up_mid_stream_frees_the_slot() -> None:
    a = ScriptedBackend("a")
    a.release.set()
    router = router_over(a)
    body = (await router.forward("/v1/completions", {"stream": True})).iter_bytes()
    assert b"replica" in await body.__anext__()
    await body.aclose()  # type: ignore[attr-defined]
    assert router.outstanding() == {}


async def test_a_cancelled_stream_frees_the_slot() -> None:
    """ASGI servers cancel the response task when the client disconnects while the replica is
    still thinking."""
    a = ScriptedBackend("a")  # never released: the first chunk never comes
    router = router_over(a)
    response = await router.forward("/v1/completions", {"stream": True})

    async def read() -> None:
        async for _ in response.iter_bytes():
            pass

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    assert router.outstanding() == {"a": 1}
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    assert router.outstanding() == {}


async def test_it_fails_over_when_a_replica_refuses_before_the_first_byte_and_then_avoids_it() -> None:
    down, up = ScriptedBackend("down", refuse=True), ScriptedBackend("up")
    up.release.set()
    router = router_over(down, up)
    for _ in range(4):
        response = await router.forward("/v1/completions", {"stream": True})
        assert response.status == 200 and response.replica == "up"
        assert b'"replica": "up"' in await drain(response.stream)
    # After the first refusal the router stops trying the down replica for a while.
    assert len(up.requests) == 4
    assert [b.key for b in router.routable()] == ["up"]


async def test_when_every_replica_refuses_the_client_gets_a_502_in_openai_shape() -> None:
    router = router_over(ScriptedBackend("x", refuse=True), ScriptedBackend("y", refuse=True))
    response = await router.forward("/v1/completions", {})
    assert response.status == 502
    error = json.loads(response.body or b"")["error"]
    assert error["type"] == "server_error" and error["code"] == "upstream_error"


async def test_a_real_refused_connection_is_a_failover_not_an_error() -> None:
    """An HttpBackend to a port nobody listens on raises BackendUnavailable: the router moves on."""
    dead = f"http://127.0.0.1:{free_port()}"
    router = Router(StaticReplicas((dead,)), model="tiny")
    response = await router.forward("/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert response.status == 502
    assert "no replica could be reached" in json.loads(response.body or b"")["error"]["message"]
    await router.aclose()


def test_the_state_file_source_lists_only_ready_replicas_and_follows_changes(tmp_path: Path) -> None:
    source = StateFileReplicas(tmp_path, rescan_s=0)
    assert source.endpoints() == []

    def write(phases: list[Phase], stopping: bool = False) -> None:
        replicas = [ReplicaState(index=i, url=f"http://127.0.0.1:{9000 + i}", phase=p) for i, p in enumerate(phases)]
        state = DeploymentState(deployment="tiny", supervisor_pid=1, updated_at=0.0, stopping=stopping, replicas=replicas)
        write_state(DeploymentDir(tmp_path), state)  # as the supervisor writes it: replaced atomically

    write(["ready", "starting", "ready", "draining"])
    assert [e.url for e in source.endpoints()] == ["http://127.0.0.1:9000", "http://127.0.0.1:9002"]
    write(["restarting", "ready", "ready", "unhealthy"])
    assert [e.url for e in source.endpoints()] == ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
    write(["ready", "ready"], stopping=True)
    assert source.endpoints() == []


def test_the_state_file_source_looks_at_its_folder_at_most_every_rescan_interval(tmp_path: Path) -> None:
    def write(url: str) -> None:
        replicas = [ReplicaState(index=0, url=url, phase="ready")]
        state = DeploymentState(deployment="tiny", supervisor_pid=1, updated_at=0.0, stopping=False, replicas=replicas)
        write_state(DeploymentDir(tmp_path), state)

    write("http://127.0.0.1:9000")
    source = StateFileReplicas(tmp_path, rescan_s=0.3)
    assert [e.url for e in source.endpoints()] == ["http://127.0.0.1:9000"]
    write("http://127.0.0.1:9001")  # a restarted replica, on a new port
    assert [e.url for e in source.endpoints()] == ["http://127.0.0.1:9000"]  # within the interval
    time.sleep(0.35)
    assert [e.url for e in source.endpoints()] == ["http://127.0.0.1:9001"]


def test_a_deployment_on_several_hosts_is_read_as_one_from_its_supervisors_folders(tmp_path: Path) -> None:
    """One supervisor per host, each writing its own folder under hosts/: the router routes to the
    ready replicas of all of them, and follows each supervisor's changes."""
    source = StateFileReplicas(tmp_path, rescan_s=0)

    def write(host: str, first: int, phases: list[Phase], stopping: bool = False) -> None:
        replicas = [
            ReplicaState(index=first + i, url=f"http://10.0.0.{first + i}:8000", phase=p) for i, p in enumerate(phases)
        ]
        state = DeploymentState(deployment="tiny", supervisor_pid=1, updated_at=0.0, stopping=stopping, replicas=replicas)
        folder = DeploymentDir(tmp_path).on_host(host)
        folder.path.mkdir(parents=True, exist_ok=True)
        write_state(folder, state)

    write("b", 2, ["ready"])
    write("a", 0, ["ready", "starting"])
    assert [e.url for e in source.endpoints()] == ["http://10.0.0.0:8000", "http://10.0.0.2:8000"]
    merged = read_state(tmp_path)
    assert merged is not None and [r.index for r in merged.replicas] == [0, 1, 2]
    write("a", 0, ["ready", "ready"])
    assert len(source.endpoints()) == 3
    # A supervisor that is stopping takes its replicas out of routing; the others' stay.
    write("b", 2, ["ready"], stopping=True)
    assert [e.url for e in source.endpoints()] == ["http://10.0.0.0:8000", "http://10.0.0.1:8000"]
    write("a", 0, ["ready", "ready"], stopping=True)
    assert source.endpoints() == []


async def test_replicas_that_left_the_source_are_forgotten_once_idle() -> None:
    class Moving:
        urls = ["http://127.0.0.1:1"]

        def endpoints(self) -> list[ReplicaEndpoint]:
            return [ReplicaEndpoint(u, u) for u in self.urls]

    source = Moving()
    router = Router(source, model="tiny")
    for port in range(2, 40):  # a replica restarting again and again, on a new port each time
        source.urls = [f"http://127.0.0.1:{port}"]
        assert [b.key for b in router.routable()] == source.urls
    assert len(router._backends) <= 2 * 1 + 8 + 1
    await router.aclose()


class AdapterReplicas:
    """Two replicas, the second of which has loaded the adapter `tuned`."""

    def endpoints(self) -> list[ReplicaEndpoint]:
        return [ReplicaEndpoint("a", "a"), ReplicaEndpoint("b", "b", frozenset({"tuned"}))]


async def test_an_adapters_requests_go_only_to_replicas_that_serve_it_and_the_gateway_lists_it_under_its_base() -> None:
    a, b = ScriptedBackend("a"), ScriptedBackend("b")
    by_key = {"a": a, "b": b}
    router = Router(AdapterReplicas(), model="tiny", backend_factory=lambda e: by_key[e.key], policy="least_loaded")
    gateway = Gateway()
    gateway.add(ServedModel(name="tiny", max_model_len=64), router)
    listed = {m["id"]: m.get("parent") for m in gateway.models()["data"]}
    assert listed == {"tiny": None, "tuned": "tiny"}

    a.release.set()
    b.release.set()
    for _ in range(3):
        answer = await gateway.handle("/v1/completions", json.dumps({"model": "tuned", "prompt": "hi"}).encode())
        assert answer.status == 200 and answer.replica == "b"
        await drain(answer.iter_bytes())
    base = [await gateway.handle("/v1/completions", json.dumps({"model": "tiny", "prompt": "hi"}).encode()) for _ in range(2)]
    assert sorted(r.replica or "" for r in base) == ["a", "b"]  # the base model goes to both
    unknown = await gateway.handle("/v1/completions", json.dumps({"model": "other", "prompt": "hi"}).encode())
    assert unknown.status == 404 and b"tuned" in (unknown.body or b"")  # the error lists what is served


def test_the_state_file_source_says_which_adapters_each_replica_serves(tmp_path: Path) -> None:
    folder = DeploymentDir(tmp_path)
    replicas = [
        ReplicaState(index=0, phase="ready", url="http://127.0.0.1:1", adapters=["tuned"]),
        ReplicaState(index=1, phase="ready", url="http://127.0.0.1:2"),
    ]
    write_state(folder, DeploymentState(deployment="tiny", supervisor_pid=1, updated_at=0, stopping=False, replicas=replicas))
    endpoints = StateFileReplicas(tmp_path).endpoints()
    assert [(e.url, e.adapters) for e in endpoints] == [("http://127.0.0.1:1", {"tuned"}), ("http://127.0.0.1:2", set())]


async def test_an_adapter_no_replica_serves_any_more_is_a_404_not_a_wait() -> None:
    # The gateway saw it listed; by the time the router picks, the replicas have unloaded it.
    a = ScriptedBackend("a")
    router = Router(StaticReplicas(("a",)), model="tiny", backend_factory=lambda e: a)
    answer = await router.forward("/v1/completions", {"model": "tuned", "prompt": "hi"})
    assert answer.status == 404 and b"tuned" in (answer.body or b"")
    await router.aclose()
