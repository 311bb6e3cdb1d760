"""/v1 passes on what vLLM's OpenAI server takes, to a real vLLM replica, called with the official
`openai` client through a real web process, and counts each key's use from vLLM's own usage.

One test with one replica (a replica's start is most of the minute this takes on CPU). The
replica serves the tiny demo model (a 256-token context, so prompts stay short) with vLLM's
hermes tool-call parser, as a deployment with `options.tool_call_parser` does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import openai
import pytest
from django.conf import settings

from deployments.models import ApiKey, Deployment
from deployments.usage import FLUSH_S
from runs.models import Checkpoint, Run
from serving.supervisor import DeploymentConfig, launch_detached, read_state, request_stop
from serving.vllm import ReplicaOptions
from tests.serving.conftest import CHECKPOINT_CACHE, process_alive, wait_until
from tools.tiny_checkpoint import build_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.django_db(transaction=True)]

MODEL = "tiny-passthrough"
HELLO = [{"role": "user", "content": "the cat"}]
PET = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "legs": {"type": "integer"}},
    "required": ["name", "legs"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture
def served(alice):
    """A ready deployment row whose folder a real supervisor (one vLLM replica) writes to."""
    checkpoint_dir = build_tiny_llama(CHECKPOINT_CACHE / "tiny-llama")
    run = Run.objects.create(owner=alice, name="tiny", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path=str(checkpoint_dir), export_path=str(checkpoint_dir))
    deployment = Deployment.objects.create(
        owner=alice, name=MODEL, checkpoint=checkpoint, served_model_name=MODEL, status="ready",
        options={"max_model_len": 256},
    )  # fmt: skip
    deployment.folder.mkdir(parents=True)
    config = DeploymentConfig(
        name=MODEL,
        checkpoint=str(checkpoint_dir),
        state_dir=str(deployment.folder),
        python=settings.VLLM_PYTHON,
        options=ReplicaOptions(
            max_model_len=256, max_num_seqs=8, dtype="float32", enforce_eager=True, tool_call_parser="hermes"
        ),
        ready_timeout_s=600,
        health_interval_s=1.0,
        drain_timeout_s=10,
    )
    pid = launch_detached(config, python=sys.executable)
    try:

        def ready() -> bool:
            assert process_alive(pid), f"supervisor exited; see {deployment.folder}/supervisor.log"
            state = read_state(deployment.folder)
            return state is not None and all(r.phase == "ready" for r in state.replicas)

        wait_until(ready, 600, "a ready replica", interval_s=1)
        yield deployment
    finally:
        state = read_state(deployment.folder)
        request_stop(deployment.folder)
        deadline = time.monotonic() + 60
        while process_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        for replica in state.replicas if state else []:
            if replica.pid and process_alive(replica.pid):
                os.killpg(replica.pid, signal.SIGKILL)
        if process_alive(pid):
            os.killpg(pid, signal.SIGKILL)


def test_v1_passes_vllms_request_fields_to_a_real_replica_and_counts_the_keys_use(served, live_web):
    key_row, key = ApiKey.issue(served)
    client = openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=key, max_retries=0, timeout=120)
    usages: list[openai.types.CompletionUsage] = []  # what vLLM reported, to compare with the key's record
    requests = 0

    def chat(**kwargs):
        nonlocal requests
        requests += 1
        reply = client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", HELLO), **kwargs)
        usages.append(reply.usage)
        return reply

    # n samples, each its own choice.
    three = chat(n=3, max_tokens=6, temperature=1.0, seed=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content for c in three.choices)
    assert 3 <= three.usage.completion_tokens <= 3 * 6

    # A JSON schema: the answer parses and fits it. (Greedy, the tiny model writes whitespace
    # until max_tokens, which the schema allows; this seed samples a short answer.)
    pet = chat(
        max_tokens=200, temperature=0.7, seed=1,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": PET, "strict": True}},
    )  # fmt: skip
    assert pet.choices[0].finish_reason == "stop", pet
    parsed = json.loads(pet.choices[0].message.content)
    assert set(parsed) == {"name", "legs"} and isinstance(parsed["name"], str) and isinstance(parsed["legs"], int)

    # A tool call the model must make, with arguments in the tool's schema.
    called = chat(max_tokens=150, temperature=0, tools=[WEATHER_TOOL], tool_choice="required")
    assert called.choices[0].finish_reason == "tool_calls", called
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    # The conversation goes on with the tool's answer.
    followed = chat(
        max_tokens=4, temperature=0, tools=[WEATHER_TOOL],
        messages=[*HELLO, called.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "sunny"}],
    )  # fmt: skip
    assert followed.choices[0].message.content is not None

    # Sampling fields: the same seed samples the same text; stop, logprobs and vLLM's own extras.
    seeded = [chat(max_tokens=8, temperature=1.0, seed=7).choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    stopped = chat(max_tokens=20, temperature=0, stop=["4"], logprobs=True, top_logprobs=2)
    assert "4" not in stopped.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in stopped.choices[0].logprobs.content)
    chosen = chat(max_tokens=4, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert chosen.choices[0].message.content in ("yes", "no")
    extras = chat(max_tokens=6, temperature=0.5, extra_body={"top_k": 1, "min_tokens": 6, "repetition_penalty": 1.1})
    assert extras.usage.completion_tokens == 6

    # Streams: usage only when asked, yet always counted for the key.
    stream_body = {"model": MODEL, "messages": HELLO, "max_tokens": 5, "temperature": 0, "stream": True}
    plain = list(client.chat.completions.create(**stream_body))
    assert all(c.choices and c.usage is None for c in plain)
    with_usage = list(client.chat.completions.create(**stream_body, stream_options={"include_usage": True}))
    assert with_usage[-1].choices == [] and with_usage[-1].usage.completion_tokens >= 1
    usages += [with_usage[-1].usage, with_usage[-1].usage]  # the same request at temperature 0, twice
    requests += 2

    # vLLM's own 400, in OpenAI's shape.
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2, logprobs=True, top_logprobs=30)
    requests += 1
    error = refused.value.response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "logprobs", None)
    assert "max allowed: 20" in error["message"]

    # What a public gateway keeps closed: the operator's fields, and every endpoint but three.
    with pytest.raises(openai.BadRequestError) as closed:
        client.chat.completions.create(model=MODEL, messages=HELLO, extra_body={"priority": -10})
    requests += 1
    assert closed.value.response.json()["error"]["param"] == "priority"
    for path in ("/v1/load_lora_adapter", "/v1/embeddings", "/v1/responses", "/v1/tokenize", "/v1/abort_requests"):
        answer = httpx.post(f"{live_web.url}{path}", json={"model": MODEL}, headers={"Authorization": f"Bearer {key}"})
        assert (answer.status_code, answer.json()["error"]["code"]) == (404, "unknown_url"), path

    # The key's record: every request it made, and the tokens vLLM reported for them.
    deadline = time.monotonic() + FLUSH_S + 10
    while time.monotonic() < deadline:
        key_row.refresh_from_db()
        if key_row.requests >= requests:
            break
        time.sleep(0.25)
    assert key_row.requests == requests
    assert key_row.prompt_tokens == sum(u.prompt_tokens for u in usages)
    assert key_row.completion_tokens == sum(u.completion_tokens for u in usages)
