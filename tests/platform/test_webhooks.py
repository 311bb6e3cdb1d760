"""Webhooks: a real HTTP receiver on 127.0.0.1 and, for the retries, a real Celery worker.

No traffic leaves loopback: names resolve through a resolver each test controls (`names`), the
system resolver is not asked, and a connection anywhere but loopback fails the test. Receivers on
loopback are reached only with the operators' allow setting (`loopback_allowed`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import queue
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.conf import settings
from django.db import transaction

from controlplane import outbound
from controlplane.celery import app as celery_app
from deployments import services as deployment_services
from deployments.models import Deployment
from notifications import services, tasks
from notifications.events import EVENTS
from notifications.models import Delivery, Webhook
from runs import services as run_services
from runs.models import Checkpoint, Run
from tests.platform.conftest import CeleryWorker, purge_broker

SECRET = "a-secret-of-some-length"
PUBLIC = "93.184.215.14"  # a public address names may resolve to; nothing ever connects to it
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class Names:
    """The resolver of these tests: a name resolves to what the test says, now; any other name
    does not resolve. Counts the lookups."""

    def __init__(self) -> None:
        self.addresses: dict[str, list[str]] = {}
        self.lookups: list[str] = []

    def __call__(self, host: str, port: int) -> list[str]:
        self.lookups.append(host)
        if host not in self.addresses:
            raise outbound.Unresolved(f"{host} does not resolve (in this test)")
        return self.addresses[host]


def _is_loopback(host: Any) -> bool:
    try:
        return ipaddress.ip_address(str(host).split("%")[0]).is_loopback
    except ValueError:
        return False


@pytest.fixture(autouse=True)
def names(monkeypatch) -> Names:
    """Every test here resolves through `Names`, and can connect to loopback only: the system
    resolver and any other address fail the test instead of sending a packet."""
    resolver = Names()
    monkeypatch.setattr(outbound, "resolve_host", resolver)
    system_getaddrinfo = socket.getaddrinfo

    def numeric_only(host: Any, *args: Any, **kwargs: Any) -> Any:
        assert host is None or _is_loopback(host), f"a name lookup of {host!r} would have left the machine"
        return system_getaddrinfo(host, *args, **kwargs)

    system_connect = socket.socket.connect

    def loopback_only(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            assert _is_loopback(address[0]), f"a connection to {address!r} would have left the machine"
        return system_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", numeric_only)
    monkeypatch.setattr(socket.socket, "connect", loopback_only)
    return resolver


@pytest.fixture
def loopback_allowed(settings) -> None:
    """The operators let webhooks reach this machine (FATHOM_WEBHOOK_ALLOW_NETWORKS=127.0.0.0/8,::1)."""
    settings.WEBHOOK_ALLOW_NETWORKS = LOOPBACK


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, tuple[Any, ...]]]:
    """The tasks sent to the workers, kept here instead (run them with `work`)."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    monkeypatch.setattr(celery_app, "send_task", lambda name, args=(), **kwargs: calls.append((name, tuple(args))))
    return calls


def work(sent: list[tuple[str, tuple[Any, ...]]], django_capture_on_commit_callbacks) -> None:
    """Runs the sent fan-outs and deliveries here, as a worker would (each delivery's last try)."""
    while sent:
        name, args = sent.pop(0)
        with django_capture_on_commit_callbacks(execute=True):
            if name == "notifications.tasks.fan_out":
                tasks.fan_out(*args)
            elif name == "notifications.tasks.deliver":
                services.do_deliver(*args, final=True)


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


def add_webhook(api, url: str, **fields: Any) -> int:
    response = api.post("/api/webhooks/", {"url": url, "secret": SECRET, **fields}, format="json")
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
def test_a_failed_run_event_carries_the_reason_and_the_failing_ranks_log(alice, alice_api, receiver, loopback_allowed):
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
def test_a_deleted_webhook_gets_nothing_more(
    alice, alice_api, receiver, loopback_allowed, django_capture_on_commit_callbacks
):
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
def test_a_4xx_is_not_retried_and_is_shown_on_the_settings_page(alice, alice_api, client, loopback_allowed):
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
    assert "Hears <code>run.succeeded</code>, <code>run.failed</code>" in page


@pytest.fixture
def loopback_worker(transactional_db, tmp_path) -> Iterator[CeleryWorker]:
    """A Celery worker whose operators allow webhooks on loopback (the conftest's `celery_worker`
    with FATHOM_WEBHOOK_ALLOW_NETWORKS)."""
    purge_broker()
    worker = CeleryWorker(
        tmp_path / "worker.log", settings.PUBLIC_URL, env={"FATHOM_WEBHOOK_ALLOW_NETWORKS": "127.0.0.0/8,::1"}
    )
    worker.start()
    yield worker
    worker.stop()


@pytest.mark.django_db(transaction=True)
def test_the_worker_delivers_a_signed_event_and_retries_after_a_500(
    alice, alice_api, failing_once_receiver, loopback_allowed, loopback_worker
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


# --- The outbound address policy (controlplane/outbound.py) -----------------------------------

INTERNAL_URLS = [
    "http://127.0.0.1:6379/",
    "http://[::1]:5432/",
    "http://10.0.0.5/",
    "http://172.16.0.9/",
    "http://192.168.1.1/",
    "http://100.64.0.1/",
    "http://[fd00::5]/",
    "http://169.254.169.254/latest/meta-data/",
    "http://[fe80::1]/",
    "http://0.0.0.0:8000/",
    "http://224.0.0.1/",
    "http://240.0.0.1/",
    "http://2130706433/",
    "http://0x7f.1/",
    "http://017700000001/",
    "http://[::ffff:127.0.0.1]/",
    "http://localhost:8000/",
    "https://internal.example/hook",  # resolves to a private address (Names below)
]


@pytest.mark.django_db
def test_every_internal_address_is_refused_at_create_and_at_update(alice_api, names):
    names.addresses["internal.example"] = [PUBLIC, "10.9.8.7"]
    for url in INTERNAL_URLS:
        response = alice_api.post("/api/webhooks/", {"url": url, "secret": SECRET}, format="json")
        assert response.status_code == 400, (url, response.json())
        [reason] = response.json()["url"]
        assert "address" in reason or "own host" in reason, (url, reason)
    assert not Webhook.objects.exists()
    refused = alice_api.post("/api/webhooks/", {"url": "http://2130706433/", "secret": SECRET}, format="json")
    assert refused.json()["url"] == ["names 127.0.0.1, a loopback address: only public addresses may be reached"]
    webhook = add_webhook(alice_api, f"https://{PUBLIC}/hook")
    for url in ("http://[::ffff:10.0.0.5]/", "https://internal.example/hook"):
        response = alice_api.patch(f"/api/webhooks/{webhook}/", {"url": url}, format="json")
        assert response.status_code == 400 and "url" in response.json()
    assert Webhook.objects.get(pk=webhook).url == f"https://{PUBLIC}/hook"


@pytest.mark.django_db
def test_a_name_that_does_not_resolve_yet_is_accepted_and_creating_a_hook_sends_nothing(
    alice_api, names, receiver, loopback_allowed
):
    add_webhook(alice_api, "https://not-yet.example/hook")
    names.addresses["public.example"] = [PUBLIC]
    add_webhook(alice_api, "https://public.example/hook")
    add_webhook(alice_api, receiver.url)
    assert names.lookups == ["not-yet.example", "public.example"]  # a literal is not looked up
    assert receiver.received.empty()
    assert not Delivery.objects.exists()


@pytest.mark.django_db
def test_a_name_that_resolves_to_loopback_at_delivery_is_refused_and_never_connected_to(
    alice, alice_api, names, receiver
):
    # Public when the hook is made; loopback (the receiver's port) when the event is delivered.
    port = receiver.server.server_address[1]
    names.addresses["rebind.example"] = [PUBLIC]
    webhook = add_webhook(alice_api, f"http://rebind.example:{port}/hook")
    names.addresses["rebind.example"] = ["127.0.0.1"]
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.SUCCEEDED)
    [delivery_id] = services.do_fan_out(alice.pk, "run.succeeded", {"run": run.pk}, "event-rebind")
    # An earlier attempt's answer (from when the name was elsewhere) is not kept either.
    Delivery.objects.filter(pk=delivery_id).update(response_code=503, response_excerpt="from before")
    lookups_before = len(names.lookups)
    # Not the final attempt, yet not retried: the refusal is final.
    assert services.do_deliver(delivery_id, final=False) == "failed"
    assert names.lookups[lookups_before:] == ["rebind.example"]
    delivery = Delivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.attempts, delivery.response_code, delivery.response_excerpt) == (
        "failed", 1, None, ""
    )  # fmt: skip
    assert delivery.last_error == (
        "refused: url has the host rebind.example, which resolves to 127.0.0.1, a loopback address: "
        "only public addresses may be reached"
    )
    assert delivery.webhook_id == webhook
    assert receiver.received.empty()
    # A settled delivery is not sent again.
    assert services.do_deliver(delivery_id, final=False) == "gone"


@pytest.mark.django_db
def test_a_hook_saved_before_the_policy_is_refused_at_delivery(alice):
    webhook = Webhook.objects.create(owner=alice, url="http://169.254.169.254/latest/meta-data/", secret=SECRET)
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.SUCCEEDED)
    [delivery_id] = services.do_fan_out(alice.pk, "run.succeeded", {"run": run.pk}, "event-old")
    assert services.do_deliver(delivery_id, final=False) == "failed"
    delivery = Delivery.objects.get(pk=delivery_id)
    assert "169.254.169.254, a link-local address" in delivery.last_error
    assert delivery.webhook_id == webhook.pk


@pytest.mark.django_db
def test_an_allowed_network_is_delivered_to_at_the_address_that_was_checked(
    alice, alice_api, names, receiver, settings
):
    # Without the operators' allow setting, the receiver on loopback is refused...
    refused = alice_api.post("/api/webhooks/", {"url": receiver.url, "secret": SECRET}, format="json")
    assert refused.status_code == 400
    # ...with it, a name that resolves into the allowed network is delivered to, connected to the
    # address it resolved to once, with the name in the Host header.
    settings.WEBHOOK_ALLOW_NETWORKS = (ipaddress.ip_network("127.0.0.0/8"),)
    port = receiver.server.server_address[1]
    names.addresses["receiver.internal"] = ["127.0.0.1"]
    add_webhook(alice_api, f"http://receiver.internal:{port}/hook")
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.SUCCEEDED)
    [delivery_id] = services.do_fan_out(alice.pk, "run.succeeded", {"run": run.pk}, "event-allowed")
    lookups_before = len(names.lookups)
    assert services.do_deliver(delivery_id, final=False) == "delivered"
    assert names.lookups[lookups_before:] == ["receiver.internal"]
    headers, body = receiver.next(timeout=10)
    assert headers["Host"] == f"receiver.internal:{port}"
    assert verify(headers, body)
    delivery = Delivery.objects.get(pk=delivery_id)
    assert (delivery.status, delivery.response_code, delivery.response_excerpt) == (
        "delivered", 200, "receiver says 200"
    )  # fmt: skip


@pytest.mark.django_db
def test_a_redirect_is_not_followed_and_a_long_answer_is_capped(alice, alice_api, loopback_allowed):
    class Redirecting(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.end_headers()
            self.wfile.write(b"x" * 100_000)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        add_webhook(alice_api, f"http://127.0.0.1:{server.server_address[1]}/hook")
        run = Run.objects.create(owner=alice, name="r", spec={})
        [delivery_id] = services.do_fan_out(alice.pk, "run.restarting", {"run": run.pk}, "event-redirect")
        assert services.do_deliver(delivery_id, final=False) == "failed"
    finally:
        server.shutdown()
        server.server_close()
    delivery = Delivery.objects.get(pk=delivery_id)
    assert (delivery.response_code, delivery.last_error) == (302, "HTTP 302")
    assert delivery.response_excerpt == "x" * services.RESPONSE_EXCERPT_CHARS


# --- The events a webhook hears ----------------------------------------------------------------


@pytest.mark.django_db
def test_events_are_writable_a_non_empty_subset_and_all_by_default(alice_api):
    everything = alice_api.post("/api/webhooks/", {"url": f"https://{PUBLIC}/a", "secret": SECRET}, format="json")
    assert everything.json()["events"] == EVENTS
    assert {"run.cancelled", "deployment.stopped"} <= set(EVENTS)
    chosen = alice_api.post(
        "/api/webhooks/",
        {"url": f"https://{PUBLIC}/b", "secret": SECRET, "events": ["deployment.stopped", "run.failed", "run.failed"]},
        format="json",
    )
    assert chosen.status_code == 201
    assert chosen.json()["events"] == ["run.failed", "deployment.stopped"]
    webhook = chosen.json()["id"]
    assert Webhook.objects.get(pk=webhook).events == ["run.failed", "deployment.stopped"]
    changed = alice_api.patch(f"/api/webhooks/{webhook}/", {"events": ["run.cancelled"]}, format="json")
    assert changed.json()["events"] == ["run.cancelled"]
    for events in ([], ["run.exploded"], "run.failed", [1]):
        refused = alice_api.patch(f"/api/webhooks/{webhook}/", {"events": events}, format="json")
        assert refused.status_code == 400, events
        assert "events" in refused.json()
    assert alice_api.get(f"/api/webhooks/{webhook}/").json()["events"] == ["run.cancelled"]


@pytest.mark.django_db
def test_a_hook_that_chose_run_failed_hears_a_failed_run_and_not_a_succeeded_one(
    alice, alice_api, receiver, loopback_allowed, sent, django_capture_on_commit_callbacks
):
    webhook = add_webhook(alice_api, receiver.url, events=["run.failed"])
    lucky = Run.objects.create(owner=alice, name="lucky", spec={}, status=Run.Status.RUNNING)
    doomed = Run.objects.create(owner=alice, name="doomed", spec={}, status=Run.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        run_services.do_set_status(lucky, Run.Status.SUCCEEDED)
    assert sent == []  # no hook hears run.succeeded: not even a fan-out task
    assert services.do_fan_out(alice.pk, "run.succeeded", {"run": lucky.pk}, "event-lucky") == []
    with django_capture_on_commit_callbacks(execute=True):
        run_services.do_set_status(doomed, Run.Status.FAILED, "rank 0 exited with 1")
    work(sent, django_capture_on_commit_callbacks)
    headers, body = receiver.next(timeout=10)
    assert headers["X-Fathom-Event"] == "run.failed"
    assert json.loads(body)["run"]["id"] == doomed.pk
    assert receiver.received.empty()
    assert [(d.event, d.status) for d in Delivery.objects.filter(webhook_id=webhook)] == [("run.failed", "delivered")]


@pytest.mark.django_db
def test_a_cancelled_run_and_a_stopped_deployment_are_events(
    alice, alice_api, receiver, loopback_allowed, sent, django_capture_on_commit_callbacks
):
    add_webhook(alice_api, receiver.url, events=["run.cancelled", "deployment.stopped"])
    queued = Run.objects.create(owner=alice, name="queued", spec={})
    with django_capture_on_commit_callbacks(execute=True):
        run_services.do_cancel_run(queued)  # a queued run is cancelled at once
    running = Run.objects.create(owner=alice, name="running", spec={}, status=Run.Status.RUNNING)
    with django_capture_on_commit_callbacks(execute=True):
        run_services.do_set_status(running, Run.Status.CANCELLED, "cancelled")
    checkpoint = Checkpoint.objects.create(run=running, step=1, path="/nowhere")
    deployment = Deployment.objects.create(
        owner=alice, name="d", checkpoint=checkpoint, served_model_name="m", status=Deployment.Status.STOPPING
    )
    with django_capture_on_commit_callbacks(execute=True):
        deployment_services.do_set_status(
            deployment, Deployment.Status.STOPPED, only_from=[Deployment.Status.STOPPING], event="stopped"
        )
    sent[:] = [call for call in sent if call[0].startswith("notifications.")]  # not the stop's own tasks
    work(sent, django_capture_on_commit_callbacks)
    heard = [json.loads(receiver.next(timeout=10)[1]) for _ in range(3)]
    assert [(p["event"], p.get("run", p.get("deployment"))["id"]) for p in heard] == [
        ("run.cancelled", queued.pk), ("run.cancelled", running.pk), ("deployment.stopped", deployment.pk)
    ]  # fmt: skip
    assert heard[2]["deployment"]["status"] == "stopped"


@pytest.mark.django_db
def test_the_guards_skips_and_rollbacks_are_events_carrying_what_the_ranks_reported(
    alice, alice_api, receiver, loopback_allowed, sent, django_capture_on_commit_callbacks
):
    add_webhook(alice_api, receiver.url, events=["run.step_skipped", "run.rolled_back"])
    run = Run.objects.create(owner=alice, name="guarded", spec={}, status=Run.Status.RUNNING)
    skipped = {"step": 5, "reason": "loss nan, gradient norm nan: not finite", "skipped": 1, "in_a_row": 1}
    rolled_back = {
        "step": 14, "to_step": 12, "source": "checkpoint", "skipped_batches": 3, "rollbacks": 1,
        "reason": "loss spike at step 14: 52.05 is 227.5 standard deviations above the mean of the steps before it",
    }  # fmt: skip
    with django_capture_on_commit_callbacks(execute=True):
        run_services.do_ingest_events(
            run, "node-0",
            [{"seq": 1, "kind": "step_skipped", "time": None, "data": skipped},
             {"seq": 2, "kind": "rolled_back", "time": None, "data": rolled_back}],
        )  # fmt: skip
    work(sent, django_capture_on_commit_callbacks)
    heard = sorted((json.loads(receiver.next(timeout=10)[1]) for _ in range(2)), key=lambda p: p["event"])
    assert [(p["event"], p["run"]["id"]) for p in heard] == [("run.rolled_back", run.pk), ("run.step_skipped", run.pk)]
    assert heard[0]["detail"] == {"kind": "rolled_back", **rolled_back}
    assert heard[1]["detail"] == {"kind": "step_skipped", **skipped}
