"""The OpenAI-compatible endpoint's gatekeeping: keys, models and request checks, in OpenAI's shape.

These run without replicas: every answer here is decided before a request would be routed. The
requests go through the web process's whole ASGI application (controlplane.asgi), as a client's
would. Serving real vLLM replicas through this endpoint is tested in test_serving_e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async

from controlplane.asgi import application
from deployments import openai_endpoint
from deployments.models import ApiKey, Deployment
from deployments.usage import USAGE
from runs.models import Checkpoint, Run
from tools.tiny_checkpoint import TinyLlamaSpec, build_tiny_llama

# transaction=True: the app drops the database connection after each key lookup, as Django does
# after a request, which a test wrapped in one transaction would not survive.
pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def use_written_while_the_database_is_there(transactional_db):
    """Writes the key use a test's requests left in this process's memory before its database
    goes (otherwise the exit flush would meet a database that is gone)."""
    yield
    async_to_sync(USAGE.flush)()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("hf"), TinyLlamaSpec(train_steps=0))


def deployment_of(owner, name: str, export: str) -> Deployment:
    run = Run.objects.create(owner=owner, name=name, spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere", export_path=export)
    return Deployment.objects.create(
        owner=owner,
        name=name,
        checkpoint=checkpoint,
        served_model_name=name,
        status=Deployment.Status.READY,
        options={"max_model_len": 64},
    )


def call(method: str, path: str, body=None, key: str | None = None) -> httpx.Response:
    """One request to the ASGI application. async_to_sync runs the app's database lookups back
    on this thread, inside the test's transaction."""
    headers = {"content-type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    content = None if body is None else body if isinstance(body, (str, bytes)) else json.dumps(body)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await client.request(method, path, content=content, headers=headers)

    return async_to_sync(send)()


def post(path: str, body, key: str | None = None) -> httpx.Response:
    return call("POST", path, body, key)


def chat(model: str, **extra):
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], **extra}


@pytest.fixture
def keys(alice, bob, hf_checkpoint):
    mine = deployment_of(alice, "alice-model", str(hf_checkpoint))
    theirs = deployment_of(bob, "bob-model", str(hf_checkpoint))
    return {"alice": ApiKey.issue(mine)[1], "bob": ApiKey.issue(theirs)[1]}


def assert_openai_error(response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def test_a_missing_or_wrong_key_is_401(keys):
    assert_openai_error(post("/v1/chat/completions", chat("alice-model")), 401, "invalid_api_key")
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), "fth-not-a-key"), 401)
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), keys["alice"][:-2] + "xx"), 401)
    assert call("GET", "/v1/models").status_code == 401


def test_another_deployments_key_is_403(keys):
    error = assert_openai_error(
        post("/v1/chat/completions", chat("alice-model"), keys["bob"]), 403, "model_not_allowed"
    )
    assert "bob-model" in error["message"]


def test_a_revoked_key_is_401(keys):
    ApiKey.objects.update(revoked=True)
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), keys["alice"]), 401)


def test_an_unknown_model_is_404(keys):
    error = assert_openai_error(
        post("/v1/chat/completions", chat("no-such-model"), keys["alice"]), 404, "model_not_found"
    )
    assert "alice-model" in error["message"]


def test_bad_sampling_parameters_are_400_naming_the_parameter(keys):
    for extra, param in [
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
    ]:
        assert_openai_error(post("/v1/chat/completions", chat("alice-model", **extra), keys["alice"]), 400, param=param)


def test_an_oversized_prompt_is_400_with_the_context_length(keys):
    body = {"model": "alice-model", "messages": [{"role": "user", "content": "lorem ipsum " * 200}]}
    error = assert_openai_error(post("/v1/chat/completions", body, keys["alice"]), 400, "context_length_exceeded")
    assert "64 tokens" in error["message"]


def test_malformed_json_is_400(keys):
    assert_openai_error(post("/v1/chat/completions", "{not json", keys["alice"]), 400)


def test_models_lists_the_keys_deployment(keys):
    response = call("GET", "/v1/models", key=keys["alice"])
    assert [m["id"] for m in response.json()["data"]] == ["alice-model"]


def test_a_ready_deployment_without_live_replicas_is_503_not_a_hang(keys):
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), keys["alice"]), 503)


def test_a_revoked_key_is_refused_once_its_cache_entry_expires(keys, monkeypatch):
    monkeypatch.setattr(openai_endpoint, "KEY_CACHE_S", 0.3)
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), keys["alice"]), 503)  # let in
    ApiKey.objects.update(revoked=True)
    time.sleep(0.4)
    assert_openai_error(post("/v1/chat/completions", chat("alice-model"), keys["alice"]), 401)


def test_a_key_in_use_is_checked_again_in_the_background_so_a_request_after_a_pause_does_not_wait(
    keys, monkeypatch
):
    """A burst that follows a quiet spell longer than the key cache's life finds its key checked:
    the lookups ran between the requests. Here lookups hang once the gate closes, so a request
    that had to wait for one would not be answered at all."""
    monkeypatch.setattr(openai_endpoint, "KEY_CACHE_S", 1.0)
    lookups = []
    gate = asyncio.Event()
    check = openai_endpoint._checked_keys

    async def gated(wanted):
        await gate.wait()
        lookups.append(time.monotonic())
        return await check(wanted)

    monkeypatch.setattr(openai_endpoint, "_checked_keys", gated)
    headers = {"Authorization": f"Bearer {keys['alice']}"}

    async def pause_between_two_requests() -> tuple[httpx.Response, httpx.Response, list[float]]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            gate.set()
            first = await client.post("/v1/chat/completions", json=chat("alice-model"), headers=headers)
            await asyncio.sleep(2.5)  # longer than KEY_CACHE_S, with no request
            in_the_pause = lookups[1:]
            gate.clear()
            try:
                second = await asyncio.wait_for(
                    client.post("/v1/chat/completions", json=chat("alice-model"), headers=headers), 10
                )
            finally:
                gate.set()  # lets a background lookup that waits there finish before the loop ends
                await asyncio.sleep(0.1)
        return first, second, in_the_pause

    first, second, in_the_pause = async_to_sync(pause_between_two_requests)()
    assert_openai_error(first, 503)  # let in, then answered: this deployment has no live replica
    assert_openai_error(second, 503)
    assert len(in_the_pause) >= 2  # each at half the entry's life, while it was in use


def test_a_key_revoked_while_kept_checked_is_refused_within_the_key_cache_time(keys, monkeypatch):
    monkeypatch.setattr(openai_endpoint, "KEY_CACHE_S", 1.0)
    headers = {"Authorization": f"Bearer {keys['alice']}"}

    async def revoke_while_in_use() -> tuple[int, float]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            assert (await client.post("/v1/chat/completions", json=chat("alice-model"), headers=headers)).status_code == 503
            await asyncio.sleep(0.6)  # the background lookups have begun
            await database_sync_to_async(ApiKey.objects.update)(revoked=True)
            revoked_at = time.monotonic()
            while True:
                response = await client.post("/v1/chat/completions", json=chat("alice-model"), headers=headers)
                if response.status_code == 401 or time.monotonic() - revoked_at > 5:
                    return response.status_code, time.monotonic() - revoked_at
                await asyncio.sleep(0.05)

    status, refused_after = async_to_sync(revoke_while_in_use)()
    assert status == 401
    assert refused_after <= openai_endpoint.KEY_CACHE_S + 0.5  # its last lookup began before the revocation


def test_unknown_paths_and_wrong_methods_answer_in_openai_shape(keys):
    assert_openai_error(post("/v1/embeddings", {"model": "alice-model"}, keys["alice"]), 404, "unknown_url")
    assert_openai_error(call("GET", "/v1/chat/completions", key=keys["alice"]), 405, "method_not_allowed")


def test_a_burst_on_one_key_checks_it_once_and_lets_every_request_in(keys, monkeypatch):
    lookups = []
    check = openai_endpoint._checked_keys

    async def counted(wanted):
        lookups.extend(wanted.values())
        return await check(wanted)

    monkeypatch.setattr(openai_endpoint, "_checked_keys", counted)
    headers = {"Authorization": f"Bearer {keys['alice']}"}

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=chat("alice-model"), headers=headers) for _ in range(20))
            )

    responses = async_to_sync(burst)()
    for response in responses:  # let in, then answered: this deployment has no live replica
        assert_openai_error(response, 503)
    assert lookups == [ApiKey.lookup_of(keys["alice"])]
