"""A deployment's API keys: made, listed with their use, limited and revoked, through the REST API
and through /v1 as a client calls it (the official `openai` client against real web processes).

No replica is needed: /v1/models answers from the key's deployment, and every answer here is
decided before a request would be routed. Token counts from real replicas are asserted in
test_v1_served.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import redis
from asgiref.sync import async_to_sync
from django.db import connection
from django.test.utils import CaptureQueriesContext
from rest_framework.authtoken.models import Token

from controlplane.asgi import application
from controlplane.web import web_command
from deployments import openai_endpoint as endpoint
from deployments.models import ApiKey, Deployment
from deployments.usage import FLUSH_S, USAGE
from runs.models import Checkpoint, Run
from tests.platform.conftest import REPO, free_port, process_env, stop, wait_for_http

pytestmark = pytest.mark.django_db(transaction=True)

REDIS_URL = "redis://127.0.0.1:6379/14"  # a database of its own: the test empties it


@pytest.fixture(autouse=True)
def use_written_while_the_database_is_there(transactional_db):
    """Writes the key use a test's requests left in this process's memory before its database
    goes (otherwise the exit flush would meet a database that is gone)."""
    yield
    async_to_sync(USAGE.flush)()


def deployment_of(owner, name: str = "alice-model", status: str = Deployment.Status.READY) -> Deployment:
    run = Run.objects.create(owner=owner, name=name, spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    return Deployment.objects.create(
        owner=owner, name=name, checkpoint=checkpoint, served_model_name=name, status=status
    )


def keys_url(deployment: Deployment) -> str:
    return f"/api/deployments/{deployment.pk}/keys/"


def client_for_v1(server_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key=key, max_retries=0, timeout=30)


# --- The REST API ------------------------------------------------------------------------------


def test_a_key_is_shown_once_then_listed_by_its_prefix_with_its_use(alice, alice_api):
    deployment = deployment_of(alice)
    created = alice_api.post(keys_url(deployment), {"name": "ci", "rate_limit_per_minute": 30}, format="json")
    assert created.status_code == 201, created.content
    secret = created.json()["key"]
    assert secret.startswith("fth-") and created.json()["prefix"] == secret[:12]
    assert created.json()["rate_limit_per_minute"] == 30

    page = alice_api.get(keys_url(deployment)).json()
    assert page["count"] == 1  # paged like every list
    (listed,) = page["results"]
    assert "key" not in listed and secret not in str(page)
    assert {k: listed[k] for k in ("name", "prefix", "last_used_at", "requests", "tokens", "revoked")} == {
        "name": "ci", "prefix": secret[:12], "last_used_at": None, "requests": 0, "tokens": 0, "revoked": False,
    }  # fmt: skip
    assert listed["created_at"]
    assert alice_api.get(f"{keys_url(deployment)}{listed['id']}/").json() == listed


def test_a_key_can_be_renamed_and_its_limit_changed_or_removed(alice, alice_api):
    deployment = deployment_of(alice)
    key_id = alice_api.post(keys_url(deployment), {}, format="json").json()["id"]
    changed = alice_api.patch(
        f"{keys_url(deployment)}{key_id}/", {"name": "prod", "rate_limit_per_minute": 5}, format="json"
    )
    assert (changed.status_code, changed.json()["name"], changed.json()["rate_limit_per_minute"]) == (200, "prod", 5)
    lifted = alice_api.patch(f"{keys_url(deployment)}{key_id}/", {"rate_limit_per_minute": None}, format="json")
    assert lifted.json()["rate_limit_per_minute"] is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rate_limit_per_minute": 0}, "rate_limit_per_minute"),
        ({"rate_limit_per_minute": "fast"}, "rate_limit_per_minute"),
        ({"name": 7}, "name"),
        ({"name": "x" * 201}, "name"),
    ],
)
def test_a_bad_key_field_is_a_400_naming_it(alice, alice_api, body, field):
    response = alice_api.post(keys_url(deployment_of(alice)), body, format="json")
    assert response.status_code == 400
    assert list(response.json()) == [field]


def test_revoking_keeps_the_key_listed_and_a_second_revoke_is_a_409(alice, alice_api):
    deployment = deployment_of(alice)
    key_id = alice_api.post(keys_url(deployment), {}, format="json").json()["id"]
    revoked = alice_api.post(f"{keys_url(deployment)}{key_id}/revoke/")
    assert revoked.status_code == 200
    assert revoked.json()["revoked"] is True and revoked.json()["revoked_at"]
    assert alice_api.get(keys_url(deployment)).json()["results"][0]["revoked"] is True
    again = alice_api.post(f"{keys_url(deployment)}{key_id}/revoke/")
    assert again.status_code == 409 and list(again.json()) == ["revoked"]
    renamed = alice_api.patch(f"{keys_url(deployment)}{key_id}/", {"name": "back"}, format="json")
    assert renamed.status_code == 409


def test_a_stopped_deployment_takes_no_new_key(alice, alice_api):
    response = alice_api.post(keys_url(deployment_of(alice, status=Deployment.Status.STOPPED)), {}, format="json")
    assert response.status_code == 409
    assert "stopped" in response.json()["status"][0]


def test_another_users_deployment_and_keys_are_404(alice, alice_api, bob_api):
    deployment = deployment_of(alice)
    key_id = alice_api.post(keys_url(deployment), {}, format="json").json()["id"]
    assert bob_api.get(keys_url(deployment)).status_code == 404
    assert bob_api.post(keys_url(deployment), {}, format="json").status_code == 404
    assert bob_api.get(f"{keys_url(deployment)}{key_id}/").status_code == 404
    assert bob_api.post(f"{keys_url(deployment)}{key_id}/revoke/").status_code == 404
    assert ApiKey.objects.get(pk=key_id).revoked is False
    assert alice_api.get("/api/deployments/999999/keys/").status_code == 404


# --- Use: counted in memory, written in batches ------------------------------------------------


def test_a_burst_of_100_chats_on_one_key_is_written_as_one_update(alice):
    deployment = deployment_of(alice)
    key, raw = ApiKey.issue(deployment)
    headers = {"Authorization": f"Bearer {raw}"}
    chat = {"model": "alice-model", "messages": [{"role": "user", "content": "hi"}]}

    async def burst() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=application)
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return await asyncio.gather(
                *(client.post("/v1/chat/completions", json=chat, headers=headers) for _ in range(100))
            )

    # async_to_sync runs the app's database calls on this thread, so its connection sees them all.
    with CaptureQueriesContext(connection) as queries:
        responses = async_to_sync(burst)()
        writes_during_burst = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
        async_to_sync(USAGE.flush)()
    # Let in, then answered 503: this deployment has no live replica.
    assert [r.status_code for r in responses] == [503] * 100
    assert writes_during_burst == []  # nothing waits on the database while requests are answered
    updates = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert len(updates) == 1, updates
    key.refresh_from_db()
    assert key.requests == 100 and key.last_used_at is not None


def test_use_through_a_web_process_shows_in_the_api_within_the_flush_interval(alice, alice_api, live_web):
    deployment = deployment_of(alice)
    created = alice_api.post(keys_url(deployment), {"name": "counted"}, format="json").json()
    client = client_for_v1(live_web.url, created["key"])
    for _ in range(3):
        assert [m.id for m in client.models.list().data] == ["alice-model"]
    deadline = time.monotonic() + FLUSH_S + 5
    listed: dict = {}
    while time.monotonic() < deadline:
        listed = alice_api.get(f"{keys_url(deployment)}{created['id']}/").json()
        if listed["requests"] == 3:
            break
        time.sleep(0.2)
    assert listed["requests"] == 3, listed
    assert listed["last_used_at"] is not None


# --- Rate limits ---------------------------------------------------------------------------------


def test_a_key_over_its_limit_gets_openais_429_with_retry_after(alice, alice_api, live_web):
    deployment = deployment_of(alice)
    created = alice_api.post(keys_url(deployment), {"rate_limit_per_minute": 3}, format="json").json()
    client = client_for_v1(live_web.url, created["key"])
    for _ in range(3):
        client.models.list()
    with pytest.raises(openai.RateLimitError) as refused:
        client.models.list()
    response = refused.value.response
    assert response.status_code == 429
    assert 1 <= int(response.headers["retry-after"]) <= 60
    assert response.headers["x-ratelimit-limit-requests"] == "3"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert created["prefix"] in error["message"] and "Limit 3" in error["message"]
    # Another key of the same deployment has its own allowance.
    other = alice_api.post(keys_url(deployment), {"rate_limit_per_minute": 3}, format="json").json()["key"]
    assert [m.id for m in client_for_v1(live_web.url, other).models.list().data] == ["alice-model"]


class WebProcesses:
    """Several web processes on one database, started with the same environment."""

    def __init__(self, count: int, tmp_path, **env: str) -> None:
        self.urls: list[str] = []
        self._processes: list[subprocess.Popen] = []
        for i in range(count):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            with (tmp_path / f"web-{i}.log").open("ab") as log:
                process = subprocess.Popen(
                    web_command(port), cwd=REPO / "platform", env=process_env(FATHOM_PUBLIC_URL=url, **env),
                    stdout=log, stderr=subprocess.STDOUT,
                )  # fmt: skip
            self._processes.append(process)
            self.urls.append(url)
        for url, process in zip(self.urls, self._processes, strict=True):
            wait_for_http(f"{url}/login/", process=process)

    def stop(self) -> None:
        for process in self._processes:
            stop(process)


@pytest.fixture
def redis_db() -> Iterator[str]:
    try:
        server = redis.Redis.from_url(REDIS_URL)
        server.ping()
    except redis.ConnectionError:
        # Shared limits are what this test is for: without Redis it fails rather than skips.
        pytest.fail(f"no Redis at {REDIS_URL}: `make test` starts one (`make services`)")
    server.flushdb()
    yield REDIS_URL
    server.flushdb()


def test_a_limit_holds_across_web_processes_that_share_redis(alice, alice_api, redis_db, tmp_path):
    deployment = deployment_of(alice)
    created = alice_api.post(keys_url(deployment), {"rate_limit_per_minute": 4}, format="json").json()
    web = WebProcesses(2, tmp_path, REDIS_URL=redis_db)
    try:
        clients = [client_for_v1(url, created["key"]) for url in web.urls]
        for i in range(4):  # alternating: two requests on each process
            clients[i % 2].models.list()
        for client in clients:  # each process alone has seen only two, yet both refuse
            with pytest.raises(openai.RateLimitError) as refused:
                client.models.list()
            assert int(refused.value.response.headers["retry-after"]) >= 1
    finally:
        web.stop()


def test_a_revoked_key_is_refused_by_every_web_process_within_the_key_cache_time(alice, alice_api, tmp_path):
    deployment = deployment_of(alice)
    created = alice_api.post(keys_url(deployment), {}, format="json").json()
    web = WebProcesses(2, tmp_path)
    try:
        clients = [client_for_v1(url, created["key"]) for url in web.urls]
        for client in clients:  # each process now holds the key as checked
            client.models.list()
        token = Token.objects.get_or_create(user=alice)[0].key
        revoked = httpx.post(
            f"{web.urls[0]}{keys_url(deployment)}{created['id']}/revoke/", headers={"Authorization": f"Token {token}"}
        )
        assert revoked.status_code == 200, revoked.text
        revoked_at = time.monotonic()
        with pytest.raises(openai.AuthenticationError):  # the process that revoked it forgets it at once
            clients[0].models.list()
        refused_after = None
        while time.monotonic() - revoked_at < endpoint.KEY_CACHE_S + 3:
            try:
                clients[1].models.list()
            except openai.AuthenticationError:
                refused_after = time.monotonic() - revoked_at
                break
            time.sleep(0.1)
        print(f"the other web process refused the revoked key after {refused_after} s")
        assert refused_after is not None and refused_after <= endpoint.KEY_CACHE_S + 0.5
    finally:
        web.stop()
