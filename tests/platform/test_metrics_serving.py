"""`/metrics` while a real vLLM replica serves through Fathom's /v1: requests, time to first token
and tokens per deployment, replica states and KV-cache use, as Prometheus would parse them.

One replica of the tiny Llama checkpoint (built once and cached, as the serving tests do), started
by a real Celery worker with beat; chats with the official openai client.
"""

from __future__ import annotations

import openai
import pytest

from deployments.models import Deployment
from runs.models import Checkpoint, Run
from tests.platform.test_prometheus_metrics import (  # noqa: F401 (web is a fixture)
    Samples,
    api,
    scrape,
    scrape_until,
    value,
    wait_for,
    web,
)
from tests.serving.conftest import CHECKPOINT_CACHE
from tools.tiny_checkpoint import build_tiny_llama

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_v1_requests_ttft_tokens_and_replicas_per_deployment(alice, web, celery_worker_with_beat):  # noqa: F811
    export = build_tiny_llama(CHECKPOINT_CACHE / "tiny-llama")
    run = Run.objects.create(owner=alice, name="served", spec={}, status=Run.Status.SUCCEEDED)
    checkpoint = Checkpoint.objects.create(run=run, step=1, path=str(export), export_path=str(export))
    client = api(web, alice)
    options = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}
    created = client.post(
        "/api/deployments/",
        json={"checkpoint": checkpoint.pk, "replicas": 1, "options": options, "served_model_name": "metered"},
    )
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        ready = wait_for(
            lambda: (d := client.get(f"/api/deployments/{deployment_id}/").json())["status"] in ("ready", "failed") and d,
            600, "a ready replica",
        )  # fmt: skip
        assert ready["status"] == "ready", ready
        key = client.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "metrics"}).json()["key"]
        before = scrape(web)

        chat = openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120).chat.completions
        messages = [{"role": "user", "content": "the cat sees"}]
        whole = chat.create(model="metered", messages=messages, max_tokens=8, temperature=0)
        chunks = list(
            chat.create(model="metered", messages=messages, max_tokens=8, temperature=0, stream=True,
                        stream_options={"include_usage": True})
        )  # fmt: skip
        streamed_usage = chunks[-1].usage
        assert whole.usage is not None and streamed_usage is not None
        # A stream whose client does not ask for usage: vLLM still reports it to the router, and
        # /metrics counts it (greedy, the same prompt: the same tokens as the whole answer).
        unasked = list(chat.create(model="metered", messages=messages, max_tokens=8, temperature=0, stream=True))
        assert all(chunk.usage is None for chunk in unasked)
        assert (
            "".join(c.choices[0].delta.content or "" for c in unasked if c.choices) == whole.choices[0].message.content
        )

        ok = {"deployment": "metered", "endpoint": "chat", "status": "200"}
        kv_cache = ("fathom_deployment_kv_cache_usage_ratio", frozenset({("deployment", "metered")}))
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
        assert value(after, ttft_count, deployment="metered") == value(before, ttft_count, deployment="metered") + 2
        ttft = value(after, "fathom_v1_time_to_first_token_seconds_sum", deployment="metered") - value(
            before, "fathom_v1_time_to_first_token_seconds_sum", deployment="metered"
        )
        assert 0 < ttft < 60
        for kind, used in (
            ("prompt", 2 * whole.usage.prompt_tokens + streamed_usage.prompt_tokens),
            ("completion", 2 * whole.usage.completion_tokens + streamed_usage.completion_tokens),
        ):
            grown = value(after, "fathom_v1_tokens_total", deployment="metered", kind=kind) - value(
                before, "fathom_v1_tokens_total", deployment="metered", kind=kind
            )
            assert grown == used, kind
        assert value(after, "fathom_replicas", deployment="metered", state="ready") == 1
        assert value(after, "fathom_replicas", deployment="metered", state="dead") == 0
        assert 0 <= value(after, "fathom_deployment_kv_cache_usage_ratio", deployment="metered") <= 1
        assert value(after, "fathom_deployments", status="ready") >= 1
    finally:
        client.post(f"/api/deployments/{deployment_id}/stop/")
        wait_for(lambda: Deployment.objects.get(pk=deployment_id).status == "stopped", 180, "the stop")
    assert value(scrape(web), "fathom_replicas", deployment="metered", state="ready") == 0
