"""A user deploys a freshly trained checkpoint in int8: the control plane quantizes its export
first (the real Celery worker runs `serving.quantize` in the llmcompressor env, calibrated on the
run's own dataset), then starts the deployment on the quantized export (a real vLLM replica that
answers the official openai client). A second int8 deploy of the checkpoint reuses that export.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
from rest_framework.authtoken.models import Token

from deployments.models import Deployment
from runs.models import QuantizedExport
from serving.quantize import SUMMARY_FILE, folder_size

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

WORDS = ["the cat sees", "a dog follows", "my friend draws", "the robot carries", "the teacher finds", "a child counts"]
# Documents (blank-line separated), so that calibration draws whole ones from the run's dataset.
CORPUS = "\n\n".join(f"{WORDS[i % 6]} {n} apples and {n + 1} pears near the river." for i, n in enumerate(range(300)))
# dtype is left to Fathom: the int8 kernel of this machine's CPU decides it (bfloat16 with AMX).
OPTIONS = {"enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}
# Few calibration documents keep GPTQ on this CPU to seconds; the task passes the setting on.
SAMPLES = 16
# int8 W8A8 matched the float32 model at 253 of 253 positions in test_quantized_export; a few
# near-ties of this smaller, briefly trained model may still fall the other way.
MIN_INT8_TOP1 = 0.9


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
def few_calibration_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set before the worker starts (it is listed first), which reads it from its environment.
    monkeypatch.setenv("FATHOM_QUANTIZE_SAMPLES", str(SAMPLES))


def _stop(api: httpx.Client, deployment_id: int) -> None:
    api.post(f"/api/deployments/{deployment_id}/stop/")
    wait_for(lambda: Deployment.objects.get(pk=deployment_id).status, lambda s: s in ("stopped", "failed"), 180, "the stop")


@pytest.mark.django_db(transaction=True)
def test_an_int8_deploy_of_a_fresh_export_quantizes_it_first_and_a_second_one_reuses_it(
    few_calibration_samples, alice, live_web, celery_worker_with_beat
):
    token = Token.objects.get_or_create(user=alice)[0].key
    api = httpx.Client(base_url=live_web.url, headers={"Authorization": f"Token {token}"}, timeout=60)
    dataset = api.post("/api/datasets/", files={"file": ("counting.txt", CORPUS.encode())}).json()
    # Trained until its next-token choices are clear-cut (as test_serving_e2e's), so that the
    # agreement measured below tells quantization error from the coin flips of a flat model.
    spec = {"train": {"steps": 160, "warmup_steps": 10, "checkpoint_interval": 160, "lr": 0.01, "min_lr": 0.001}}
    run = api.post("/api/runs/", json={"name": "quantizable", "dataset": dataset["id"], "spec": spec}).json()
    checkpoints = wait_for(
        lambda: api.get(f"/api/runs/{run['id']}/checkpoints/").json(),
        lambda c: c and c[-1]["export_path"], 600, "the trained run's export",
    )  # fmt: skip
    checkpoint = checkpoints[-1]
    assert checkpoint["quantized_exports"] == []

    created = api.post("/api/deployments/", json={
        "checkpoint": checkpoint["id"], "quantization": "int8", "options": OPTIONS, "served_model_name": "counting-int8",
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
        client = openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=key, max_retries=0, timeout=120)
        answer = client.completions.create(model="counting-int8", prompt="the cat sees", max_tokens=8, temperature=0)
        assert answer.choices[0].text
        _stop(api, first["id"])

        # A second int8 deploy of the same checkpoint starts on the same export, quantizing nothing.
        again = api.post("/api/deployments/", json={
            "checkpoint": checkpoint["id"], "quantization": "int8", "options": OPTIONS, "served_model_name": "counting-again",
        })  # fmt: skip
        assert again.status_code == 201, again.text
        ids.append(again.json()["id"])
        assert again.json()["quantized_export"] == row.pk
        second = wait_for(
            lambda: api.get(f"/api/deployments/{ids[1]}/").json(),
            lambda d: d["status"] in ("ready", "failed"), 600, "the second deployment's replica",
        )  # fmt: skip
        assert second["status"] == "ready", second
        kinds = [e["kind"] for e in history(api, f"/api/deployments/{ids[1]}/events/")]
        assert "waiting_for_quantization" not in kinds and "supervisor_started" in kinds
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
