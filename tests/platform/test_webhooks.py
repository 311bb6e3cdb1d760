"""Webhooks: a real HTTP receiver on 127.0.0.1 and, for the retries, a real Celery worker."""

from __future__ import annotations

import hashlib
import hmac
import json
import queue
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.db import transaction

from deployments import services as deployment_services
from deployments.models import Deployment
from notifications import services
from notifications.models import Delivery, Webhook
from runs import services as run_services
from runs.models import Checkpoint, Run

SECRET = "a-secret-of-some-length"


class Receiver:
    """An HTTP server thread that answers POSTs with the codes it is given, in turn (200 once
    they run out), and keeps what it was sent."""

    def __init__(self, codes: list[int]) -> None:
        self.codes = list(codes)
        self.received: queue.Queue[tuple[dict[str, str], bytes]] = queue.Queue()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.put((dict(self.headers), body))
                code = receiver.codes.pop(0) if receiver.codes else 200
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"receiver says %d" % code)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def next(self, timeout: float = 90.0) -> tuple[dict[str, str], bytes]:
        return self.received.get(timeout=timeout)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver([])
    yield r
    r.close()


@pytest.fixture
def failing_once_receiver() -> Iterator[Receiver]:
    r = Receiver([500])
    yield r
    r.close()


def verify(headers: dict[str, str], body: bytes, secret: str = SECRET) -> bool:
    """What a receiver does: recompute the HMAC over "<timestamp>.<raw body>" and compare."""
    timestamp = headers["X-Fathom-Timestamp"]
    expected = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-Fathom-Signature"], f"sha256={expected}")


def add_webhook(api, url: str) -> int:
    response = api.post("/api/webhooks/", {"url": url, "secret": SECRET}, format="json")
    assert response.status_code == 201, response.json()
    assert "secret" not in response.json()
    return int(response.json()["id"])


@pytest.mark.django_db
def test_it_refuses_a_url_that_is_not_http_or_https(alice_api):
    for url in ("ftp://example.com/hook", "file:///etc/passwd", "example.com/hook"):
        response = alice_api.post("/api/webhooks/", {"url": url, "secret": SECRET}, format="json")
        assert response.status_code == 400
        assert "http:// or https://" in response.json()["url"][0]
    short = alice_api.post("/api/webhooks/", {"url": "https://example.com/hook", "secret": "short"}, format="json")
    assert short.status_code == 400
    assert "secret" in short.json()


@pytest.mark.django_db
def test_another_users_webhook_answers_404(alice_api, bob_api):
    webhook = add_webhook(alice_api, "https://example.com/hook")
    assert bob_api.get(f"/api/webhooks/{webhook}/").status_code == 404
    assert bob_api.get(f"/api/webhooks/{webhook}/deliveries/").status_code == 404
    assert (
        bob_api.patch(f"/api/webhooks/{webhook}/", {"url": "https://evil.example/"}, format="json").status_code == 404
    )
    assert bob_api.delete(f"/api/webhooks/{webhook}/").status_code == 404
    assert bob_api.get("/api/webhooks/").json()["results"] == []
    assert Webhook.objects.get(pk=webhook).url == "https://example.com/hook"


@pytest.mark.django_db
def test_a_rolled_back_status_change_notifies_no_one(alice, alice_api, django_capture_on_commit_callbacks):
    add_webhook(alice_api, "https://example.com/hook")
    run = Run.objects.create(owner=alice, name="r", spec={})
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            run_services.do_set_status(run, Run.Status.SUCCEEDED)
            raise RuntimeError("the change is rolled back")
    assert callbacks == []
    # The same change committed queues the event (and only the status changes named for webhooks).
    with django_capture_on_commit_callbacks() as callbacks:
        run_services.do_set_status(run, Run.Status.RUNNING)
    running_callbacks = len(callbacks)
    with django_capture_on_commit_callbacks() as callbacks:
        run_services.do_set_status(run, Run.Status.SUCCEEDED)
    assert len(callbacks) == running_callbacks + 1


@pytest.mark.django_db
def test_a_failed_run_event_carries_the_reason_and_the_failing_ranks_log(alice, alice_api, receiver):
    webhook = add_webhook(alice_api, receiver.url)
    run = Run.objects.create(owner=alice, name="doomed", spec={}, status=Run.Status.RUNNING)
    log = run.run_dir.rank_log(1)
    log.parent.mkdir(parents=True)
    log.write_text("".join(f"line {i}\n" for i in range(100)) + "RuntimeError: CUDA error: out of memory\n")
    run_services.do_ingest_events(
        run,
        "node-0",
        [{"seq": 1, "kind": "failed", "time": None, "data": {"reason": "rank 1 exited with 1", "rank": 1}}],
    )
    [delivery_id] = services.do_fan_out(alice.pk, "run.failed", {"run": run.pk}, "event-1")
    # The fan-out is idempotent: a redelivered task makes no second delivery.
    assert services.do_fan_out(alice.pk, "run.failed", {"run": run.pk}, "event-1") == [delivery_id]
    assert services.do_deliver(delivery_id, final=False) == "delivered"
    headers, body = receiver.next()
    assert verify(headers, body)
    assert not verify(headers, body, secret="another secret")
    assert headers["X-Fathom-Event"] == "run.failed"
    payload = json.loads(body)
    assert payload["id"] == "event-1"
    assert payload["run"]["id"] == run.pk
    assert payload["run"]["status"] == "failed"
    assert payload["run"]["reason"] == "rank 1 exited with 1"
    assert payload["log"]["rank"] == 1
    assert payload["log"]["lines"][-1] == "RuntimeError: CUDA error: out of memory"
    assert len(payload["log"]["lines"]) == services.FAILED_LOG_LINES
    delivery = Delivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.attempts, delivery.response_code) == ("delivered", 1, 200)
    assert delivery.webhook_id == webhook


@pytest.mark.django_db
def test_a_deleted_webhook_gets_nothing_more(alice, alice_api, receiver, django_capture_on_commit_callbacks):
    webhook = add_webhook(alice_api, receiver.url)
    run = Run.objects.create(owner=alice, name="r", spec={})
    [in_flight] = services.do_fan_out(alice.pk, "run.succeeded", {"run": run.pk}, "event-2")
    assert alice_api.delete(f"/api/webhooks/{webhook}/").status_code == 204
    # A delivery queued (or waiting for its retry) before the deletion finds its webhook gone.
    assert services.do_deliver(in_flight, final=False) == "gone"
    # And a later status change queues nothing at all.
    with django_capture_on_commit_callbacks() as callbacks:
        run_services.do_set_status(run, Run.Status.SUCCEEDED)
    enqueued_after = len(callbacks)
    add_webhook(alice_api, "https://example.com/other")
    other = Run.objects.create(owner=alice, name="r2", spec={})
    with django_capture_on_commit_callbacks() as callbacks:
        run_services.do_set_status(other, Run.Status.SUCCEEDED)
    assert len(callbacks) == enqueued_after + 1
    assert receiver.received.empty()


@pytest.mark.django_db
def test_a_4xx_is_not_retried_and_is_shown_on_the_settings_page(alice, alice_api, client):
    bad = Receiver([404])
    try:
        add_webhook(alice_api, bad.url)
        run = Run.objects.create(owner=alice, name="r", spec={})
        [delivery_id] = services.do_fan_out(alice.pk, "run.restarting", {"run": run.pk}, "event-3")
        assert services.do_deliver(delivery_id, final=False) == "failed"
    finally:
        bad.close()
    delivery = Delivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.response_code, delivery.last_error) == ("failed", 404, "HTTP 404")
    client.force_login(alice)
    page = client.get("/settings/webhooks").content.decode()
    assert bad.url in page
    assert "run.restarting" in page
    assert "receiver says 404" in page


@pytest.mark.django_db(transaction=True)
def test_the_worker_delivers_a_signed_event_and_retries_after_a_500(
    alice, alice_api, failing_once_receiver, celery_worker
):
    receiver = failing_once_receiver
    webhook = add_webhook(alice_api, receiver.url)
    run = Run.objects.create(owner=alice, name="lucky", spec={})
    run_services.do_set_status(run, Run.Status.SUCCEEDED)

    first_headers, first_body = receiver.next()
    second_headers, second_body = receiver.next()
    assert verify(first_headers, first_body)
    assert verify(second_headers, second_body)
    assert json.loads(second_body)["event"] == "run.succeeded"
    assert json.loads(second_body)["run"]["id"] == run.pk
    # The same event (its id) both times; the receiver could drop a repeat.
    assert first_headers["X-Fathom-Delivery"] == second_headers["X-Fathom-Delivery"]

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not Delivery.objects.filter(status="delivered").exists():
        time.sleep(0.2)
    delivery = Delivery.objects.get(webhook_id=webhook)
    assert (delivery.status, delivery.attempts, delivery.response_code) == ("delivered", 2, 200)
    assert delivery.response_excerpt == "receiver says 200"
    listed = alice_api.get(f"/api/webhooks/{webhook}/deliveries/").json()
    assert [d["status"] for d in listed] == ["delivered"]


@pytest.mark.django_db
def test_a_deployment_that_becomes_ready_or_fails_is_an_event(alice, alice_api, django_capture_on_commit_callbacks):
    add_webhook(alice_api, "https://example.com/hook")
    run = Run.objects.create(owner=alice, name="r", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="m")
    with django_capture_on_commit_callbacks() as callbacks:
        deployment_services.do_set_status(deployment, Deployment.Status.STARTING, only_from=Deployment.ACTIVE)
    starting = len(callbacks)
    with django_capture_on_commit_callbacks() as callbacks:
        deployment_services.do_set_status(deployment, Deployment.Status.READY, only_from=Deployment.ACTIVE)
    assert len(callbacks) == starting + 1
    [delivery_id] = services.do_fan_out(alice.pk, "deployment.ready", {"deployment": deployment.pk}, "event-4")
    payload = Delivery.objects.get(pk=delivery_id).payload
    assert payload["deployment"]["status"] == "ready"
    assert payload["deployment"]["served_model_name"] == "m"
