"""`GET /metrics` as a Prometheus server scrapes it, from real web and worker processes.

Every scrape is parsed with prometheus_client's own text parser. Values are compared before and
after what an operator would do (submit a run, call /v1, open a page), so other processes of the
test session that share the metric folder do not matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import websockets
from django.conf import settings
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families
from rest_framework.authtoken.models import Token

from controlplane.observability_asgi import DeploymentNames
from deployments.models import ApiKey, Deployment
from runs.models import Checkpoint, Run
from runs.tasks import export_checkpoint
from tests.platform.conftest import WebServer, free_port

TOKEN = "operator-metrics-token"
STORY = "\n".join(f"Ada walked to the harbour and counted {n} kites before the rain." for n in range(200))

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def start_web(monkeypatch: pytest.MonkeyPatch, log) -> WebServer:  # type: ignore[no-untyped-def]
    """A web process with the metrics token set and JSON logs."""
    monkeypatch.setenv("FATHOM_METRICS_TOKEN", TOKEN)
    monkeypatch.setenv("FATHOM_LOG_FORMAT", "json")
    server = WebServer(free_port(), log)
    server.start()
    return server


@pytest.fixture
def web(monkeypatch, transactional_db, tmp_path) -> Iterator[WebServer]:
    server = start_web(monkeypatch, tmp_path / "web.log")
    old, settings.PUBLIC_URL = settings.PUBLIC_URL, server.url  # where agents post events
    yield server
    settings.PUBLIC_URL = old
    server.stop()


def scrape(server: WebServer) -> Samples:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain; version=")  # the text exposition format
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(predicate, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := predicate():
            return result
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def scrape_until(server: WebServer, predicate, timeout: float, what: str) -> Samples:  # type: ignore[no-untyped-def]
    """Scrapes until `predicate(samples)` holds (what is counted as a request ends, or by the
    worker's next sync, may trail what a client saw by a moment); returns those samples."""
    found: list[Samples] = []
    wait_for(lambda: predicate(s := scrape(server)) and not found.append(s), timeout, what)
    return found[0]


def api(server: WebServer, user) -> httpx.Client:  # type: ignore[no-untyped-def]
    token = Token.objects.get_or_create(user=user)[0].key
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Token {token}"}, timeout=30)


def test_metrics_answer_only_to_the_operators_token(web):
    missing = httpx.get(f"{web.url}/metrics")
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{web.url}/metrics", headers={"Authorization": "Bearer not-the-token"}).status_code == 403
    assert httpx.get(f"{web.url}/metrics", headers={"Authorization": f"Token {TOKEN}"}).status_code == 401
    samples = scrape(web)
    names = {name for name, _ in samples}
    for family in ("fathom_runs", "fathom_deployments", "fathom_run_queue_wait_seconds_count", "fathom_run_events_ingested_total"):
        assert family in names, sorted(names)


@pytest.mark.django_db
def test_metrics_are_off_until_a_token_is_set(settings):
    settings.METRICS_TOKEN = ""
    response = Client().get("/metrics", HTTP_AUTHORIZATION="Bearer anything")
    assert response.status_code == 403
    assert "FATHOM_METRICS_TOKEN" in response.content.decode()


def test_a_submitted_run_is_counted_queued_then_cancelled(alice, web):
    client = api(web, alice)
    before = scrape(web)
    dataset = client.post("/api/datasets/", files={"file": ("story.txt", STORY.encode())}).json()
    created = client.post("/api/runs/", json={"name": "waiting", "recipe": "tiny", "dataset": dataset["id"]})
    assert created.status_code == 201, created.text
    queued = scrape(web)  # no worker runs: the run waits in the queue
    assert value(queued, "fathom_runs", status="queued") == value(before, "fathom_runs", status="queued") + 1
    assert client.post(f"/api/runs/{created.json()['id']}/cancel/").status_code == 200
    cancelled = scrape(web)
    assert value(cancelled, "fathom_runs", status="queued") == value(before, "fathom_runs", status="queued")
    assert value(cancelled, "fathom_runs", status="cancelled") == value(before, "fathom_runs", status="cancelled") + 1


def test_a_run_is_counted_by_status_queue_wait_and_events_from_submit_to_cancel(alice, web, celery_worker):
    client = api(web, alice)
    before = scrape(web)
    dataset = client.post("/api/datasets/", files={"file": ("story.txt", STORY.encode())}).json()
    spec = {"train": {"steps": 100000, "checkpoint_interval": 100000}}
    created = client.post("/api/runs/", json={"name": "metered", "recipe": "tiny", "dataset": dataset["id"], "spec": spec})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    try:
        # A worker claims the launch (one more wait in the histogram) and the agent reports.
        queue_waits = value(before, "fathom_run_queue_wait_seconds_count")
        ingested = value(before, "fathom_run_events_ingested_total")
        after = scrape_until(
            web,
            lambda s: value(s, "fathom_run_queue_wait_seconds_count") == queue_waits + 1
            and value(s, "fathom_run_events_ingested_total") > ingested,
            120, "the launch's queue wait and the agent's first events",
        )  # fmt: skip
        active = sum(value(after, "fathom_runs", status=s) for s in Run.ACTIVE)
        assert active == sum(value(before, "fathom_runs", status=s) for s in Run.ACTIVE) + 1
        waited = value(after, "fathom_run_queue_wait_seconds_sum") - value(before, "fathom_run_queue_wait_seconds_sum")
        assert 0 <= waited < 120
    finally:
        client.post(f"/api/runs/{run_id}/cancel/")
    wait_for(lambda: Run.objects.get(pk=run_id).status == Run.Status.CANCELLED, 120, "the cancel")
    cancelled = scrape(web)
    assert value(cancelled, "fathom_runs", status="cancelled") == value(before, "fathom_runs", status="cancelled") + 1
    assert sum(value(cancelled, "fathom_runs", status=s) for s in Run.Status.values) == sum(
        value(before, "fathom_runs", status=s) for s in Run.Status.values
    ) + 1


async def open_websocket(server: WebServer, token: str, run_id: int):  # type: ignore[no-untyped-def]
    url = server.url.replace("http", "ws") + f"/ws/runs/{run_id}/?after=0"
    return await websockets.connect(url, additional_headers={"Authorization": f"Token {token}"}, origin=server.url)


@pytest.mark.django_db(transaction=True)
def test_two_web_processes_are_added_up_and_a_killed_ones_clients_drop(alice, monkeypatch, tmp_path):
    first = start_web(monkeypatch, tmp_path / "first.log")
    second = start_web(monkeypatch, tmp_path / "second.log")
    try:
        before = scrape(second)
        chat = {"model": "nobody", "messages": [{"role": "user", "content": "hi"}]}
        for server in (first, first, second):
            assert httpx.post(f"{server.url}/v1/chat/completions", json=chat).status_code == 401
        unauthorized = {"deployment": "", "endpoint": "chat", "status": "401"}
        for server in (first, second):  # either process answers for both
            assert value(scrape(server), "fathom_v1_requests_total", **unauthorized) == (
                value(before, "fathom_v1_requests_total", **unauthorized) + 3
            )

        run = Run.objects.create(owner=alice, name="watched", spec={})
        token = Token.objects.get_or_create(user=alice)[0].key
        loop = asyncio.new_event_loop()
        socket = loop.run_until_complete(open_websocket(first, token, run.pk))
        clients = value(before, "fathom_websocket_clients", stream="runs")
        wait_for(lambda: value(scrape(second), "fathom_websocket_clients", stream="runs") == clients + 1, 10,
                 "the other process's client to be counted")  # fmt: skip

        assert first.process is not None
        first.process.send_signal(signal.SIGKILL)  # no goodbye: its count must still go
        first.process.wait()
        after = scrape(second)
        assert value(after, "fathom_websocket_clients", stream="runs") == clients, "the killed process's client"
        # What the killed process counted stays in the totals: a rate must not see a drop.
        assert value(after, "fathom_v1_requests_total", **unauthorized) == value(before, "fathom_v1_requests_total", **unauthorized) + 3
        with contextlib.suppress(websockets.ConnectionClosed):
            loop.run_until_complete(socket.close())
        loop.close()
    finally:
        first.stop()
        second.stop()


def test_a_failed_task_and_a_deployment_without_replicas_count_as_errors(alice, web, celery_worker):
    run = Run.objects.create(owner=alice, name="served", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(
        owner=alice, name="gone", checkpoint=checkpoint, served_model_name="gone", status=Deployment.Status.READY
    )  # ready in the database, but no replica answers
    key = ApiKey.issue(deployment)[1]
    before = scrape(web)

    chat = {"model": "gone", "messages": [{"role": "user", "content": "hi"}]}
    answer = httpx.post(f"{web.url}/v1/chat/completions", json=chat, headers={"Authorization": f"Bearer {key}"})
    assert answer.status_code == 503, answer.text
    export_checkpoint.delay(checkpoint.pk + 1000)  # no such checkpoint: the task raises

    failures = value(before, "fathom_task_failures_total", task="runs.tasks.export_checkpoint")
    after = scrape_until(
        web, lambda s: value(s, "fathom_task_failures_total", task="runs.tasks.export_checkpoint") == failures + 1,
        60, "the worker's failed task",
    )  # fmt: skip
    unavailable = {"deployment": "gone", "endpoint": "chat", "status": "503"}
    assert value(after, "fathom_v1_requests_total", **unavailable) == value(before, "fathom_v1_requests_total", **unavailable) + 1
    errors = value(before, "fathom_http_errors_total", where="v1", status="503")
    assert value(after, "fathom_http_errors_total", where="v1", status="503") == errors + 1
    # The worker logs as JSON too (FATHOM_LOG_FORMAT=json), the task's traceback inside its line.
    assert celery_worker.log.exists()
    records = [json.loads(line) for line in celery_worker.log.read_text().splitlines() if line.strip()]
    assert any("Traceback" in r.get("exception", "") for r in records if r["level"] == "ERROR")


@pytest.mark.django_db(transaction=True)
def test_answers_that_end_while_the_served_names_are_read_carry_their_deployment_too(alice):
    # The first answer naming a deployment not yet known reads the names from the database; the
    # answers that end while that read is under way (a client's next requests, a burst) must
    # wait for it, not be counted under no deployment. A made-up name stays unlabelled.
    run = Run.objects.create(owner=alice, name="served", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    Deployment.objects.create(owner=alice, name="m", checkpoint=checkpoint, served_model_name="metered")
    names = DeploymentNames()

    async def answers_ending_together() -> list[str]:
        return await asyncio.gather(*(names.known(name) for name in ("metered", "metered", "metered", "made-up")))

    assert asyncio.run(answers_ending_together()) == ["metered", "metered", "metered", ""]
