"""Checks before proxying, and the OpenAI shape of every error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import transformers

from serving.gateway import Gateway
from serving.openai_errors import OpenAIError, normalize_error_body
from serving.openai_requests import PromptCounter, ServedModel, check_request
from serving.router import Router, StaticReplicas


@pytest.fixture(scope="module")
def model(tiny_checkpoint: Path) -> ServedModel:
    return ServedModel(name="tiny", max_model_len=64, counter=PromptCounter(tiny_checkpoint))


def chat(content: str = "hello", **extra: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": content}], **extra}


def error_of(path: str, body: object, model: ServedModel) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        check_request(path, body, {model.name: model})
    return caught.value


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 0}, "n"),
        ({"n": 129}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"stream": "yes"}, "stream"),
        ({"presence_penalty": 3}, "presence_penalty"),
    ],
)
def test_it_rejects_bad_sampling_parameters_naming_the_parameter(model: ServedModel, extra: dict, param: str) -> None:
    error = error_of("/v1/chat/completions", chat(**extra), model)
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", param)


def test_it_accepts_the_edges_of_each_range(model: ServedModel) -> None:
    for extra in ({"temperature": 0}, {"temperature": 2}, {"top_p": 1}, {"max_tokens": 1}, {"n": 1}, {"stream": True}):
        assert check_request("/v1/chat/completions", chat(**extra), {"tiny": model}) is model


def test_an_unknown_model_is_a_404_naming_the_available_ones(model: ServedModel) -> None:
    error = error_of("/v1/completions", {"model": "gpt-5", "prompt": "hi"}, model)
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert "tiny" in error.message


def test_a_missing_model_or_a_non_object_body_is_a_400(model: ServedModel) -> None:
    assert error_of("/v1/completions", {"prompt": "hi"}, model).param == "model"
    assert error_of("/v1/completions", ["hi"], model).status == 400


def test_prompt_tokens_are_counted_with_the_deployments_tokenizer_and_chat_template(tiny_checkpoint: Path) -> None:
    """The counts match transformers' tokenizer on the same checkpoint, chat template included."""
    counter = PromptCounter(tiny_checkpoint)
    reference = transformers.AutoTokenizer.from_pretrained(tiny_checkpoint)
    text = "the cat sees three apples near the sea."
    assert counter.count_text(text) == len(reference(text).input_ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str)
    assert counter.count_chat(messages) == len(reference(rendered, add_special_tokens=False).input_ids)


def test_a_chat_template_in_chat_template_jinja_counts_as_transformers_renders_it(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # A pretrained folder of transformers 4.43+ (a deployment serves it as it is): the template
    # lies beside the config, not in it.
    folder = tmp_path / "folder"
    shutil.copytree(tiny_checkpoint, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    own = "{% for m in messages %}{{ m['role'] | upper + ' says ' + m['content'] + '\n' }}{% endfor %}ASSISTANT says"
    (folder / "chat_template.jinja").write_text(own)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sees three apples"}]
    rendered = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert isinstance(rendered, str) and rendered.startswith("SYSTEM says be brief")
    assert PromptCounter(folder).count_chat(messages) == len(reference(rendered, add_special_tokens=False).input_ids)


def test_a_prompt_that_leaves_no_room_for_a_completion_is_rejected(model: ServedModel) -> None:
    long_text = "the cat sees a dog " * 40
    error = error_of("/v1/completions", {"model": "tiny", "prompt": long_text}, model)
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "64" in error.message
    assert error_of("/v1/chat/completions", chat(long_text), model).param == "messages"
    assert error_of("/v1/completions", {"model": "tiny", "prompt": list(range(64))}, model).param == "prompt"


def test_a_prompt_plus_max_tokens_over_the_context_is_rejected(model: ServedModel) -> None:
    error = error_of("/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 63}, model)
    assert (error.param, error.code) == ("max_tokens", "context_length_exceeded")
    check_request("/v1/completions", {"model": "tiny", "prompt": "the cat", "max_tokens": 40}, {"tiny": model})


def test_an_unknown_endpoint_is_a_404(model: ServedModel) -> None:
    assert error_of("/v1/embeddings", {"model": "tiny"}, model).status == 404


def test_vllm_error_bodies_are_given_openais_type_and_code() -> None:
    raw = json.dumps(
        {
            "error": {
                "message": "temperature must be non-negative",
                "type": "BadRequestError",
                "param": "temperature",
                "code": 400,
            }
        }
    )
    body = json.loads(normalize_error_body(400, raw.encode()))
    assert body == {
        "error": {
            "message": "temperature must be non-negative",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


def test_a_non_json_upstream_failure_becomes_a_server_error_body() -> None:
    body = json.loads(normalize_error_body(500, b"Internal Server Error"))
    assert body["error"]["type"] == "server_error"
    assert body["error"]["message"] == "Internal Server Error"
    assert set(body["error"]) == {"message", "type", "param", "code"}


async def test_the_gateway_answers_bad_json_and_missing_replicas_in_openai_shape(model: ServedModel) -> None:
    gateway = Gateway()
    gateway.add(model, Router(StaticReplicas(()), model="tiny"))
    try:
        bad_json = await gateway.handle("/v1/completions", b"{not json")
        assert bad_json.status == 400
        assert json.loads(bad_json.body or b"")["error"]["type"] == "invalid_request_error"
        none_ready = await gateway.handle("/v1/completions", json.dumps({"model": "tiny", "prompt": "hi"}).encode())
        assert none_ready.status == 503
        assert json.loads(none_ready.body or b"")["error"]["code"] == "no_healthy_replica"
        assert [m["id"] for m in gateway.models()["data"]] == ["tiny"]
    finally:
        await gateway.aclose()
