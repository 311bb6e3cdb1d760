"""The OpenAI-compatible endpoint's gatekeeping: keys, models and request checks, in OpenAI's shape.

These run without replicas: every answer here is decided before a request would be routed.
Serving real vLLM replicas through this endpoint is tested in test_serving_e2e.py.
"""

from __future__ import annotations

import json

import pytest

from deployments.models import ApiKey, Deployment
from runs.models import Checkpoint, Run
from serving.tiny_checkpoint import TinyLlamaSpec, build_tiny_llama

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("hf"), TinyLlamaSpec(train_steps=0))


def deployment_of(owner, name: str, export: str) -> Deployment:
    run = Run.objects.create(owner=owner, name=name, spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere", export_path=export)
    return Deployment.objects.create(
        owner=owner, name=name, checkpoint=checkpoint, served_model_name=name,
        status=Deployment.Status.READY, options={"max_model_len": 64},
    )


def post(client, path: str, body, key: str | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {key}"} if key else {}
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return client.post(path, data=data, content_type="application/json", **headers)


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


def test_a_missing_or_wrong_key_is_401(client, keys):
    assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model")), 401, "invalid_api_key")
    assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model"), "fth-not-a-key"), 401)
    assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model"), keys["alice"][:-2] + "xx"), 401)
    assert client.get("/v1/models").status_code == 401


def test_another_deployments_key_is_403(client, keys):
    error = assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model"), keys["bob"]), 403, "model_not_allowed")
    assert "bob-model" in error["message"]


def test_a_revoked_key_is_401(client, keys):
    ApiKey.objects.update(revoked=True)
    assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model"), keys["alice"]), 401)


def test_an_unknown_model_is_404(client, keys):
    error = assert_openai_error(post(client, "/v1/chat/completions", chat("no-such-model"), keys["alice"]), 404, "model_not_found")
    assert "alice-model" in error["message"]


def test_bad_sampling_parameters_are_400_naming_the_parameter(client, keys):
    for extra, param in [({"temperature": 3}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": 0}, "max_tokens"), ({"n": 0}, "n")]:
        assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model", **extra), keys["alice"]), 400, param=param)


def test_an_oversized_prompt_is_400_with_the_context_length(client, keys):
    body = {"model": "alice-model", "messages": [{"role": "user", "content": "lorem ipsum " * 200}]}
    error = assert_openai_error(post(client, "/v1/chat/completions", body, keys["alice"]), 400, "context_length_exceeded")
    assert "64 tokens" in error["message"]


def test_malformed_json_is_400(client, keys):
    assert_openai_error(post(client, "/v1/chat/completions", "{not json", keys["alice"]), 400)


def test_models_lists_the_keys_deployment(client, keys):
    response = client.get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {keys['alice']}")
    assert [m["id"] for m in response.json()["data"]] == ["alice-model"]


def test_a_ready_deployment_without_live_replicas_is_503_not_a_hang(client, keys):
    assert_openai_error(post(client, "/v1/chat/completions", chat("alice-model"), keys["alice"]), 503)
