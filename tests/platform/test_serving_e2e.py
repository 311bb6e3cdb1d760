"""Train → export → deploy → chat through Fathom with the openai client, in float32 and in int8,
on one freshly trained checkpoint (its training is most of a minute; both halves share it).

- float32, on two real vLLM replicas: what Fathom serves must be the checkpoint it trained:
  prompt logprobs through the control plane's endpoint match `transformers` on the same export
  within 1e-3, and greedy completions agree on at least 9 of 10 prompts.
- int8: the control plane quantizes the export first (the real Celery worker runs
  `serving.quantize` in the llmcompressor env, calibrated on the run's own dataset), then starts
  the deployment on the quantized export (a real vLLM replica that answers the official openai
  client). A second int8 deploy of the checkpoint reuses that export, and the export's quality
  (top-1 agreement and perplexity against the float export) is measured and shown.
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
from runs.models import QuantizedExport
from serving.quantize import SUMMARY_FILE, folder_size
from tests.platform.conftest import CeleryWorker, purge_broker

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# A small, repetitive corpus: a few hundred steps make the tiny model's next-token choices
# clear-cut, so two float32 engines agree on greedy decoding for real reasons, not by luck, and
# int8's agreement with the float model tells quantization error from the coin flips of a flat
# model. Documents (blank-line separated), so that calibration draws whole ones.
WORDS = ["the cat sees", "a dog follows", "my friend draws", "the robot carries", "the teacher finds", "a child counts"]
CORPUS = "\n\n".join(f"{WORDS[i % 6]} {n} apples and {n + 1} pears near the river." for i, n in enumerate(range(600)))
PROMPTS = ["the cat sees", "a dog follows", "my friend draws 3", "the robot carries 12 apples",
           "the teacher finds 7", "a child counts", "the cat sees 40 apples and", "a dog follows 9 apples",
           "my friend", "the robot"]  # fmt: skip
NEW_TOKENS = 12
# dtype is left to Fathom for int8: the int8 kernel of this machine's CPU decides it (bfloat16
# with AMX).
INT8_OPTIONS = {"enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}
# Few calibration documents keep GPTQ on this CPU to seconds; the task passes the setting on.
SAMPLES = 16
# int8 W8A8 matched the float32 model at 253 of 253 positions in test_quantized_export; a few
# near-ties of this smaller, briefly trained model may still fall the other way.
MIN_INT8_TOP1 = 0.9
# The replicas' ports as an administrator narrowed them (a firewall rule's range).
REPLICA_PORTS = range(28700, 28720)


def wait_for(fetch, predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if predicate(value):
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {value}")


def history(api: httpx.Client, url: str) -> list[dict]:  # type: ignore[type-arg]
    """Every event at `url`, read a page at a time (`?after=SEQ`) as a page does."""
    events: list[dict] = []  # type: ignore[type-arg]
    while page := api.get(url, params={"after": events[-1]["seq"] if events else 0}).json():
        events += page
    return events


@pytest.fixture
def worker(transactional_db, tmp_path) -> Iterator[CeleryWorker]:
    """A worker with beat whose replicas take ports of REPLICA_PORTS, quantizing with SAMPLES
    calibration documents (both read from its environment)."""
    purge_broker()
    worker = CeleryWorker(tmp_path / "worker.log", settings.PUBLIC_URL, beat=True, env={
        "FATHOM_REPLICA_PORT_MIN": str(REPLICA_PORTS.start), "FATHOM_REPLICA_PORT_MAX": str(REPLICA_PORTS.stop - 1),
        "FATHOM_QUANTIZE_SAMPLES": str(SAMPLES),
    })  # fmt: skip
    worker.start()
    yield worker
    worker.stop()


def _stop(api: httpx.Client, deployment_id: int) -> None:
    api.post(f"/api/deployments/{deployment_id}/stop/")
    wait_for(lambda: Deployment.objects.get(pk=deployment_id).status, lambda s: s in ("stopped", "failed"), 180, "the stop")


@pytest.mark.django_db(transaction=True)
def test_a_trained_checkpoint_is_served_in_float32_by_two_replicas_and_in_int8_from_an_export_quantized_once(
    alice, live_web, worker
):
    token = Token.objects.get_or_create(user=alice)[0].key
    api = httpx.Client(base_url=live_web.url, headers={"Authorization": f"Token {token}"}, timeout=60)
    dataset = api.post("/api/datasets/", files={"file": ("counting.txt", CORPUS.encode())}).json()
    spec = {"train": {"steps": 160, "warmup_steps": 10, "checkpoint_interval": 160, "lr": 0.01, "min_lr": 0.001}}
    run = api.post("/api/runs/", json={"name": "servable", "dataset": dataset["id"], "spec": spec}).json()
    checkpoints = wait_for(
        lambda: api.get(f"/api/runs/{run['id']}/checkpoints/").json(),
        lambda c: c and c[-1]["export_path"], 600, "the trained run's export",
    )  # fmt: skip
    checkpoint = checkpoints[-1]
    assert checkpoint["quantized_exports"] == []
    _served_in_float32_by_two_replicas_as_transformers_computes_it(api, live_web.url, checkpoint)
    _served_in_int8_from_an_export_quantized_once(api, live_web.url, run, dataset, checkpoint)


def _served_in_float32_by_two_replicas_as_transformers_computes_it(api: httpx.Client, url: str, checkpoint: dict) -> None:  # type: ignore[type-arg]
    export = Path(checkpoint["export_path"])
    options = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 16, "kv_cache_gib": 1}
    created = api.post("/api/deployments/", json={"checkpoint": checkpoint["id"], "replicas": 2, "options": options,
                                                  "served_model_name": "counting"})  # fmt: skip
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        deployment = wait_for(
            lambda: api.get(f"/api/deployments/{deployment_id}/").json(),
            lambda d: d["status"] in ("ready", "failed"), 900, "two ready replicas",
        )  # fmt: skip
        assert deployment["status"] == "ready", deployment
        assert [r["status"] for r in deployment["replica_set"]] == ["ready", "ready"]
        assert all(urlsplit(r["url"]).port in REPLICA_PORTS for r in deployment["replica_set"]), deployment
        key = api.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "test"}).json()["key"]

        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
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
            ).choices[0].model_extra  # fmt: skip
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
        )  # fmt: skip
        # Each replica announced ready once (a replica that missed health checks under load and
        # recovered adds a "healthy again" one).
        first_ready = [e["data"]["replica"] for e in events if e["kind"] == "replica_ready" and not e["data"]["message"]]
        assert sorted(first_ready) == [0, 1]
    finally:
        api.post(f"/api/deployments/{deployment_id}/stop/")
        wait_for(lambda: Deployment.objects.get(pk=deployment_id).status, lambda s: s == "stopped", 180, "the stop")
    state = json.loads((Deployment.objects.get(pk=deployment_id).folder / "state.json").read_text())
    assert all(r["phase"] == "stopped" for r in state["replicas"])


def _served_in_int8_from_an_export_quantized_once(
    api: httpx.Client, url: str, run: dict, dataset: dict, checkpoint: dict  # type: ignore[type-arg]
) -> None:
    created = api.post("/api/deployments/", json={
        "checkpoint": checkpoint["id"], "quantization": "int8", "options": INT8_OPTIONS, "served_model_name": "counting-int8",
    })  # fmt: skip
    assert created.status_code == 201, created.text
    first = created.json()
    assert (first["quantization"], first["status"], first["options"]["quantization"]) == ("int8", "pending", "int8_w8a8")
    ids = [first["id"]]
    try:
        deployment = wait_for(
            lambda: api.get(f"/api/deployments/{first['id']}/").json(),
            lambda d: d["status"] in ("ready", "failed"), 900, "the quantized deployment's replica",
        )  # fmt: skip
        assert deployment["status"] == "ready", deployment

        # The run's history shows the quantize task's stages, then its result.
        run_events = history(api, f"/api/runs/{run['id']}/events/")
        quantize_events = [e for e in run_events if e["kind"] in ("quantizing", "quantized", "quantize_failed")]
        assert [e["data"].get("stage", e["kind"]) for e in quantize_events] == [
            "loading", "calibrating", "saving", "quantized",
        ]  # fmt: skip
        assert quantize_events[1]["data"]["samples"] == SAMPLES
        # The deployment waited for it, then started on the quantized export.
        kinds = [e["kind"] for e in history(api, f"/api/deployments/{first['id']}/events/")]
        assert kinds[:3] == ["created", "waiting_for_quantization", "quantized"], kinds
        assert kinds.index("supervisor_started") > kinds.index("quantized")

        row = QuantizedExport.objects.get()
        source = Path(checkpoint["export_path"])
        assert (row.scheme, row.status, row.samples) == ("int8", "ready", SAMPLES)
        assert row.size_bytes == folder_size(Path(row.path)) and row.source_size_bytes == folder_size(source)
        assert row.size_bytes < row.source_size_bytes
        assert (Path(row.path) / SUMMARY_FILE).is_file()
        assert row.calibration == api.get(f"/api/datasets/{dataset['id']}/").json()["path"]
        shown = api.get(f"/api/runs/{run['id']}/checkpoints/").json()[-1]["quantized_exports"]
        assert [(q["scheme"], q["status"], q["size_bytes"], q["source_size_bytes"]) for q in shown] == [
            ("int8", "ready", row.size_bytes, row.source_size_bytes)
        ]

        key = api.post(f"/api/deployments/{first['id']}/keys/", json={"name": "test"}).json()["key"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        answer = client.completions.create(model="counting-int8", prompt="the cat sees", max_tokens=8, temperature=0)
        assert answer.choices[0].text
        _stop(api, first["id"])

        # A second int8 deploy of the same checkpoint starts on the same export, quantizing nothing.
        again = api.post("/api/deployments/", json={
            "checkpoint": checkpoint["id"], "quantization": "int8", "options": INT8_OPTIONS, "served_model_name": "counting-again",
        })  # fmt: skip
        assert again.status_code == 201, again.text
        ids.append(again.json()["id"])
        assert again.json()["quantized_export"] == row.pk
        # Its supervisor starts at once, on the export the first one served from; that replica's
        # start is the first one's again, so the test stops it there.
        kinds = wait_for(
            lambda: [e["kind"] for e in history(api, f"/api/deployments/{ids[1]}/events/")],
            lambda k: "supervisor_started" in k or "failed" in k, 300, "the second deployment's supervisor",
        )  # fmt: skip
        assert "failed" not in kinds and "waiting_for_quantization" not in kinds, kinds
        second = api.get(f"/api/deployments/{ids[1]}/").json()
        assert second["status"] in ("starting", "ready") and second["quantized_export"] == row.pk, second
        _stop(api, ids[1])
        assert QuantizedExport.objects.count() == 1
        run_events = history(api, f"/api/runs/{run['id']}/events/")
        assert [e["kind"] for e in run_events].count("quantized") == 1
        assert sum(e["kind"] == "quantizing" and e["data"]["stage"] == "loading" for e in run_events) == 1

        # Its quality, measured on replicas of the float and the int8 export over the run's fixed
        # prompts, is stored with it and shown with the checkpoint.
        measured = wait_for(
            lambda: [e for e in history(api, f"/api/runs/{run['id']}/events/") if e["kind"].startswith("quality_")],
            bool, 900, "the quality measurement",
        )  # fmt: skip
        assert [e["kind"] for e in measured] == ["quality_measured"], measured
        shown = api.get(f"/api/runs/{run['id']}/checkpoints/").json()[-1]["quantized_exports"][0]
        print(f"int8 top-1 agreement {shown['top1']:.4f} over {shown['top1_positions']} positions; "
              f"perplexity {shown['perplexity']:.4f} vs float {shown['source_perplexity']:.4f}; "
              f"size {shown['size_bytes']} / {shown['source_size_bytes']} bytes")  # fmt: skip
        assert shown["top1_positions"] >= 200
        assert shown["top1"] >= MIN_INT8_TOP1
        # The goal for int8: held-out perplexity within 2% of the float export's.
        assert shown["perplexity"] <= 1.02 * shown["source_perplexity"]
        assert shown["source_perplexity"] > 1.0
    finally:
        for deployment_id in ids:
            if Deployment.objects.get(pk=deployment_id).status in Deployment.ACTIVE:
                _stop(api, deployment_id)
