"""/v1 on one real vLLM replica of the tiny Llama (built once and cached, as the serving tests
do), deployed through the API as a pretrained model and started by a real Celery worker with
beat, called with the official `openai` client through a real web process:

- it passes on what vLLM's OpenAI server takes (n, JSON schemas, tool calls, sampling fields,
  vLLM's extras and its own 400s) and keeps the operator's fields and other endpoints closed;
- it counts each key's use from vLLM's own usage;
- `/metrics` shows requests, time to first token and tokens per deployment, replica states and
  KV-cache use, as Prometheus would parse them;
- a LoRA run's checkpoint attached through the API is served by the same replica, with the
  deployment's key, as transformers computes the merged model, and answers 404 once detached.

One test with one replica: a replica's start is most of the minute this takes on CPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import transformers

from deployments.models import ApiKey, Deployment
from deployments.openai_endpoint import KEY_CACHE_S
from deployments.usage import FLUSH_S
from runs.models import Checkpoint, PretrainedModel, Run
from tests.platform.conftest import WebServer
from tests.platform.test_prometheus_metrics import (  # noqa: F401 (web is a fixture)
    Samples,
    api,
    scrape,
    scrape_until,
    value,
    wait_for,
    web,
)
from tests.serving.conftest import CHECKPOINT_CACHE, lora_checkpoint_on, process_alive
from tools.tiny_checkpoint import build_tiny_llama
from training.export import export

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

MODEL = "metered"
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


def test_v1_on_a_real_replica_passes_vllms_fields_counts_each_keys_use_and_meters_requests_ttft_tokens_and_replicas(
    alice, web, celery_worker_with_beat, tmp_path  # noqa: F811
):
    base = PretrainedModel.objects.create(
        owner=alice, name="tiny llama", path=str(build_tiny_llama(CHECKPOINT_CACHE / "tiny-llama"))
    )
    client = api(web, alice)
    # A 256-token context keeps prompts short; vLLM's hermes tool-call parser, as a deployment
    # with `options.tool_call_parser` has; LoRA on, for an adapter attached later.
    options = {
        "dtype": "float32", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8, "kv_cache_gib": 1,
        "tool_call_parser": "hermes", "max_loras": 1, "max_lora_rank": 8,
    }  # fmt: skip
    created = client.post(
        "/api/deployments/",
        json={"pretrained": base.pk, "replicas": 1, "options": options, "served_model_name": MODEL},
    )
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        ready = wait_for(
            lambda: (d := client.get(f"/api/deployments/{deployment_id}/").json())["status"] in ("ready", "failed") and d,
            600, "a ready replica",
        )  # fmt: skip
        assert ready["status"] == "ready", ready
        _passes_vllms_request_fields_and_counts_the_keys_use(web, Deployment.objects.get(pk=deployment_id))

        key = client.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "metrics"}).json()["key"]
        before = scrape(web)

        chat = openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120).chat.completions
        messages = [{"role": "user", "content": "the cat sees"}]
        whole = chat.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        chunks = list(
            chat.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
                        stream_options={"include_usage": True})
        )  # fmt: skip
        streamed_usage = chunks[-1].usage
        assert whole.usage is not None and streamed_usage is not None
        # A stream whose client does not ask for usage: vLLM still reports it to the router, and
        # /metrics counts it (greedy, the same prompt: the same tokens as the whole answer).
        unasked = list(chat.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True))
        assert all(chunk.usage is None for chunk in unasked)
        assert (
            "".join(c.choices[0].delta.content or "" for c in unasked if c.choices) == whole.choices[0].message.content
        )

        ok = {"deployment": MODEL, "endpoint": "chat", "status": "200"}
        kv_cache = ("fathom_deployment_kv_cache_usage_ratio", frozenset({("deployment", MODEL)}))
        # A request is counted as its answer ends, and serving figures arrive with the next sync.
        requests = value(before, "fathom_v1_requests_total", **ok)
        seen: list[Samples] = []

        def counted(samples: Samples) -> bool:
            seen[:] = [samples]
            return kv_cache in samples and value(samples, "fathom_v1_requests_total", **ok) == requests + 3

        try:
            after = scrape_until(web, counted, 60, "the three chats counted and the deployment's serving figures")
        except AssertionError as timed_out:
            # Say which half was missing, and what the deployment went through meanwhile.
            last = seen[0] if seen else {}
            events = Deployment.objects.get(pk=deployment_id).events.order_by("-seq")[:8]
            raise AssertionError(
                f"{timed_out}: requests counted {value(last, 'fathom_v1_requests_total', **ok)} of {requests + 3}; "
                f"serving figures {'present' if kv_cache in last else 'absent'}; last deployment events "
                f"{[(e.kind, e.data) for e in events]}"
            ) from None
        ttft_count = "fathom_v1_time_to_first_token_seconds_count"
        assert value(after, ttft_count, deployment=MODEL) == value(before, ttft_count, deployment=MODEL) + 2
        ttft = value(after, "fathom_v1_time_to_first_token_seconds_sum", deployment=MODEL) - value(
            before, "fathom_v1_time_to_first_token_seconds_sum", deployment=MODEL
        )
        assert 0 < ttft < 60
        for kind, used in (
            ("prompt", 2 * whole.usage.prompt_tokens + streamed_usage.prompt_tokens),
            ("completion", 2 * whole.usage.completion_tokens + streamed_usage.completion_tokens),
        ):
            grown = value(after, "fathom_v1_tokens_total", deployment=MODEL, kind=kind) - value(
                before, "fathom_v1_tokens_total", deployment=MODEL, kind=kind
            )
            assert grown == used, kind
        assert value(after, "fathom_replicas", deployment=MODEL, state="ready") == 1
        assert value(after, "fathom_replicas", deployment=MODEL, state="dead") == 0
        assert 0 <= value(after, "fathom_deployment_kv_cache_usage_ratio", deployment=MODEL) <= 1
        assert value(after, "fathom_deployments", status="ready") >= 1

        _serves_an_attached_adapter_as_the_merged_model(client, web, deployment_id, key, base, tmp_path)
        _sleeps_when_idle_and_a_request_wakes_it(client, web, deployment_id, key)
    finally:
        client.post(f"/api/deployments/{deployment_id}/stop/")
        wait_for(lambda: Deployment.objects.get(pk=deployment_id).status == "stopped", 180, "the stop")
    assert value(scrape(web), "fathom_replicas", deployment=MODEL, state="ready") == 0


def _serves_an_attached_adapter_as_the_merged_model(
    client: httpx.Client, server: WebServer, deployment_id: int, key: str, base: PretrainedModel, tmp: Path
) -> None:
    trained = lora_checkpoint_on(Path(base.path), tmp / "lora")
    run = Run.objects.create(
        owner=base.owner, name="tuned", spec={"lora": {"rank": 8}}, status=Run.Status.SUCCEEDED, pretrained=base
    )
    checkpoint = Checkpoint.objects.create(run=run, step=6, path=str(trained))
    attached = client.post(f"/api/deployments/{deployment_id}/adapters/", json={"checkpoint": checkpoint.pk})
    assert attached.status_code == 201, attached.text
    name = attached.json()["name"]
    assert name == "tuned-step6"

    v1 = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
    # The worker exports its PEFT folder and the supervisor has the replica load it: no restart.
    def models() -> dict[str, str | None]:
        return {m.id: (m.model_extra or {}).get("parent") for m in v1.models.list().data}

    listed = wait_for(lambda: name in (now := models()) and now, 120, "the adapter in /v1/models")
    assert listed == {MODEL: None, name: MODEL}
    assert Deployment.objects.get(pk=deployment_id).replica_set.get().restarts == 0

    torch.set_num_threads(1)
    merged = export(trained, tmp / "merged")
    model = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = transformers.AutoTokenizer.from_pretrained(merged)("the cat sees").input_ids
    with torch.no_grad():
        greedy = model.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long), eos_token_id=None,
        )[0, len(ids):].tolist()  # fmt: skip
    answer = v1.completions.create(
        model=name, prompt="the cat sees", max_tokens=8, temperature=0, extra_body={"return_token_ids": True}
    )
    served = list((answer.choices[0].model_extra or {})["token_ids"])
    assert served == greedy[: len(served)] and served

    detached = client.delete(f"/api/deployments/{deployment_id}/adapters/{attached.json()['id']}/")
    assert detached.status_code == 204

    def gone() -> bool:
        try:
            v1.completions.create(model=name, prompt="the cat", max_tokens=1)
        except openai.NotFoundError:
            return True
        return False

    wait_for(gone, 60, "the detached adapter to answer 404")


def _sleeps_when_idle_and_a_request_wakes_it(client: httpx.Client, server: WebServer, deployment_id: int, key: str) -> None:
    """Scaled to zero: idle, it stops its replica and is asleep; a request then wakes it and is
    held, answered 503 with Retry-After past the wake timeout, and answered once a replica is ready."""
    url = f"/api/deployments/{deployment_id}/autoscaling/"
    policy = {"min_replicas": 0, "max_replicas": 1, "idle_s": 4, "wake_timeout_s": 1}
    put = client.put(url, json={"autoscaling": policy})
    assert put.status_code == 200, put.text
    supervisor = Deployment.objects.get(pk=deployment_id).supervisor_pid
    asleep = wait_for(
        lambda: (d := client.get(f"/api/deployments/{deployment_id}/").json())["status"] == "asleep" and d,
        120, "the idle deployment to sleep",
    )  # fmt: skip
    assert asleep["replicas"] == 0 and [r["status"] for r in asleep["replica_set"]] == ["stopped"]
    deployment = Deployment.objects.get(pk=deployment_id)
    scaled = deployment.events.filter(kind="scaled").last()
    assert scaled is not None and (scaled.data["from"], scaled.data["to"]) == (1, 0)
    assert scaled.data["reason"].startswith("no request for ")
    assert deployment.events.filter(kind="asleep").exists()
    wait_for(lambda: not process_alive(supervisor), 60, "its supervisor to exit")

    v1 = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=300)
    # Held for the wake timeout (1 s; a replica takes longer to start), then told when to retry.
    with pytest.raises(openai.InternalServerError) as refused:
        v1.completions.create(model=MODEL, prompt="the cat sees", max_tokens=4, temperature=0)
    assert refused.value.status_code == 503 and refused.value.response.headers["retry-after"] == "1"
    assert refused.value.code == "model_waking"
    assert Deployment.objects.get(pk=deployment_id).events.filter(kind="waking").count() == 1

    # A longer wake timeout: held until the replica it started is ready, then answered.
    policy = {**policy, "idle_s": 600, "wake_timeout_s": 240}
    put = client.put(url, json={"autoscaling": policy})
    assert put.status_code == 200, (put.text, list(Deployment.objects.get(pk=deployment_id).events.values_list("kind", "data")))
    time.sleep(KEY_CACHE_S + 1)  # the web process reads the policy again with the key
    answer = v1.completions.create(model=MODEL, prompt="the cat sees", max_tokens=4, temperature=0)
    assert answer.choices[0].text and answer.usage.completion_tokens == 4
    awake = Deployment.objects.get(pk=deployment_id)
    assert awake.replicas == 1 and awake.events.filter(kind="waking").count() == 1
    wait_for(lambda: Deployment.objects.get(pk=deployment_id).status == "ready", 60, "the woken deployment ready")


def _passes_vllms_request_fields_and_counts_the_keys_use(server: WebServer, deployment: Deployment) -> None:
    key_row, key = ApiKey.issue(deployment)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=120)
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
        answer = httpx.post(f"{server.url}{path}", json={"model": MODEL}, headers={"Authorization": f"Bearer {key}"})
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
