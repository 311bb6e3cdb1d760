"""Train → export → deploy on two real vLLM replicas → chat through Fathom with the openai client.

What Fathom serves must be the checkpoint it trained: prompt logprobs through the control
plane's endpoint match `transformers` on the same export (float32) within 1e-3, and greedy
completions agree on at least 9 of 10 prompts.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import torch
import transformers
from django.conf import settings
from rest_framework.authtoken.models import Token

from deployments.models import Deployment
from tests.platform.conftest import CeleryWorker, purge_broker

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# A small, repetitive corpus: a few hundred steps make the tiny model's next-token choices
# clear-cut, so two float32 engines agree on greedy decoding for real reasons, not by luck.
WORDS = ["the cat sees", "a dog follows", "my friend draws", "the robot carries", "the teacher finds", "a child counts"]
CORPUS = "\n".join(f"{WORDS[i % 6]} {n} apples and {n + 1} pears near the river." for i, n in enumerate(range(600)))
PROMPTS = ["the cat sees", "a dog follows", "my friend draws 3", "the robot carries 12 apples",
           "the teacher finds 7", "a child counts", "the cat sees 40 apples and", "a dog follows 9 apples",
           "my friend", "the robot"]  # fmt: skip
NEW_TOKENS = 12


def wait_for(fetch, predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if predicate(value):
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {value}")


# The replicas' ports as an administrator narrowed them (a firewall rule's range).
REPLICA_PORTS = range(28700, 28720)


@pytest.fixture
def worker_with_replica_ports(transactional_db, tmp_path) -> Iterator[CeleryWorker]:
    purge_broker()
    worker = CeleryWorker(tmp_path / "worker.log", settings.PUBLIC_URL, beat=True, env={
        "FATHOM_REPLICA_PORT_MIN": str(REPLICA_PORTS.start), "FATHOM_REPLICA_PORT_MAX": str(REPLICA_PORTS.stop - 1),
    })  # fmt: skip
    worker.start()
    yield worker
    worker.stop()


@pytest.mark.django_db(transaction=True)
def test_a_trained_checkpoint_is_served_by_two_replicas_through_fathom(alice, live_web, worker_with_replica_ports):
    token = Token.objects.get_or_create(user=alice)[0].key
    api = httpx.Client(base_url=live_web.url, headers={"Authorization": f"Token {token}"}, timeout=60)
    dataset = api.post("/api/datasets/", files={"file": ("counting.txt", CORPUS.encode())}).json()
    spec = {"train": {"steps": 160, "warmup_steps": 10, "checkpoint_interval": 160, "lr": 0.01, "min_lr": 0.001}}
    run = api.post("/api/runs/", json={"name": "servable", "dataset": dataset["id"], "spec": spec}).json()
    checkpoints = wait_for(
        lambda: api.get(f"/api/runs/{run['id']}/checkpoints/").json(),
        lambda c: c and c[-1]["export_path"], 600, "the trained run's export",
    )
    export = Path(checkpoints[-1]["export_path"])

    options = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 16, "kv_cache_gib": 1}
    created = api.post("/api/deployments/", json={"checkpoint": checkpoints[-1]["id"], "replicas": 2, "options": options,
                                                  "served_model_name": "counting"})
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        deployment = wait_for(
            lambda: api.get(f"/api/deployments/{deployment_id}/").json(),
            lambda d: d["status"] in ("ready", "failed"), 900, "two ready replicas",
        )
        assert deployment["status"] == "ready", deployment
        assert [r["status"] for r in deployment["replica_set"]] == ["ready", "ready"]
        assert all(urlsplit(r["url"]).port in REPLICA_PORTS for r in deployment["replica_set"]), deployment
        key = api.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "test"}).json()["key"]

        client = openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["counting"]
        messages = [{"role": "user", "content": "the cat sees"}]
        whole = client.chat.completions.create(model="counting", messages=messages, max_tokens=NEW_TOKENS, temperature=0)
        assert whole.choices[0].message.content
        streamed = client.chat.completions.create(
            model="counting", messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True
        )
        chunks = [c for c in streamed if c.choices]
        # Server-sent events through Fathom: the answer's pieces, then one that ends it. (vLLM
        # merges tokens into one piece when its reader lags, so the count of pieces varies.)
        assert len(chunks) >= 2
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content

        torch.set_num_threads(1)
        reference = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(export)
        worst_gap, same = 0.0, 0
        for prompt in PROMPTS:
            ids = tokenizer(prompt).input_ids
            served = client.completions.create(
                model="counting", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"prompt_logprobs": 0, "return_token_ids": True},
            ).choices[0].model_extra
            with torch.no_grad():
                expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), dim=-1)
                greedy = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            for position in range(1, len(ids)):
                served_logprob = served["prompt_logprobs"][position][str(ids[position])]["logprob"]
                worst_gap = max(worst_gap, abs(served_logprob - expected[position - 1, ids[position]].item()))
            same += list(served["token_ids"]) == greedy[0, len(ids):].tolist()
        print(f"worst prompt logprob gap {worst_gap:.2e}; {same}/{len(PROMPTS)} greedy completions identical")
        assert worst_gap < 1e-3
        assert same >= 9

        events = wait_for(
            lambda: api.get(f"/api/deployments/{deployment_id}/events/").json(),
            lambda e: any(x["kind"] == "metrics" and x["data"].get("tokens_per_s", 0) > 0 for x in e), 60,
            "serving metrics with tokens/s",
        )
        # Each replica announced ready once (a replica that missed health checks under load and
        # recovered adds a "healthy again" one).
        first_ready = [e["data"]["replica"] for e in events if e["kind"] == "replica_ready" and not e["data"]["message"]]
        assert sorted(first_ready) == [0, 1]
    finally:
        api.post(f"/api/deployments/{deployment_id}/stop/")
        wait_for(lambda: Deployment.objects.get(pk=deployment_id).status, lambda s: s == "stopped", 180, "the stop")
    state = json.loads((Deployment.objects.get(pk=deployment_id).folder / "state.json").read_text())
    assert all(r["phase"] == "stopped" for r in state["replicas"])
