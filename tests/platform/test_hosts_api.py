"""Hosts joining with the cluster's join token and beating with their own secret, listed for
users, drained and removed by staff, marked lost when their heartbeats stop. On the real database,
through the REST API."""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
from django.utils import timezone

from hosts.models import Host
from hosts.tasks import watch_hosts
from tests.platform.conftest import client_for

pytestmark = pytest.mark.django_db

TOKEN = "join-token-for-tests"
# The secret each host name was given when it joined, as its host worker keeps it.
host_secrets: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _no_host_has_joined():
    host_secrets.clear()


def beat(client, name="gpu-a", token=None, slots=2, address="10.9.0.11", **extra):
    """A host worker's beat: with the host's own secret once it has joined, else the join token
    (or `token`, as given)."""
    body = {
        "name": name,
        "address": address,
        "devices": [{"index": i, "kind": "cpu"} for i in range(slots)],
        "labels": {"zone": "a"},
        **extra,
    }
    token = host_secrets.get(name, TOKEN) if token is None else token
    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"} if token else {}
    response = client.post("/api/hosts/heartbeat/", json.dumps(body), content_type="application/json", **headers)
    if response.status_code == 200 and "host_secret" in response.json():
        host_secrets[name] = response.json()["host_secret"]
    return response


@pytest.fixture
def join_token(settings):
    settings.JOIN_TOKEN = TOKEN
    return TOKEN


def test_without_a_join_token_set_no_host_joins_and_the_refusal_is_logged(client, settings, caplog):
    settings.JOIN_TOKEN = ""
    with caplog.at_level(logging.WARNING, logger="hosts.views"):
        response = beat(client)
    assert response.status_code == 401
    assert "FATHOM_JOIN_TOKEN is not set" in response.json()["detail"]
    assert "FATHOM_JOIN_TOKEN is not set" in caplog.text
    assert not Host.objects.exists()


@pytest.mark.parametrize("token", ["", "wrong-token"])
def test_a_heartbeat_without_the_right_token_is_refused_and_logged(client, join_token, caplog, token):
    with caplog.at_level(logging.WARNING, logger="hosts.views"):
        response = beat(client, token=token)
    assert response.status_code == 401
    assert "refused" in caplog.text
    assert not Host.objects.exists()


def test_the_first_heartbeat_registers_the_host_and_the_next_refresh_it(client, join_token, alice_api):
    joined = beat(client, running=[{"key": "run-1-node-0", "pid": 42}]).json()
    assert joined["status"] == "ready" and len(joined["host_secret"]) >= 40
    first_seen = Host.objects.get(name="gpu-a").last_seen
    assert beat(client, slots=3).json() == {"status": "ready"}  # with its own secret: no new one
    hosts = alice_api.get("/api/hosts/").json()["results"]
    assert len(hosts) == 1
    host = hosts[0]
    assert (host["name"], host["address"], host["status"], host["kind"]) == ("gpu-a", "10.9.0.11", "ready", "cpu")
    assert [d["index"] for d in host["devices"]] == [0, 1, 2] and host["free"] == 3
    assert host["labels"] == {"zone": "a"} and host["running"] == []
    assert Host.objects.get(name="gpu-a").last_seen >= first_seen


def test_a_heartbeat_with_a_bad_body_names_the_field(client, join_token):
    response = beat(client, name="no spaces allowed")
    assert response.status_code == 400 and "name" in response.json()
    response = beat(client, devices=[{"index": 0, "kind": "cpu"}, {"index": 0, "kind": "cpu"}])
    assert response.status_code == 400 and "devices" in response.json()
    response = beat(client, cpu_flags=["avx2", "rm -rf"])
    assert response.status_code == 400 and list(response.json()) == ["cpu_flags"]
    assert not Host.objects.exists()


def test_a_heartbeat_keeps_the_hosts_cpu_flags_and_a_worker_that_sends_none_has_unknown_ones(client, join_token):
    assert beat(client, cpu_flags=["avx", "avx2", "fma"]).status_code == 200
    assert Host.objects.get().cpu_flags == ["avx", "avx2", "fma"]
    assert Host.objects.get().serving_device().has_cpu_int4_kernel is False
    assert beat(client).status_code == 200  # an older host worker
    assert Host.objects.get().cpu_flags == []
    assert Host.objects.get().serving_device().has_cpu_int4_kernel is True  # vLLM on the host has the last word


def test_hosts_are_for_signed_in_users_only(client):
    assert client.get("/api/hosts/").status_code in (401, 403)


def test_staff_drain_and_undrain_a_host_and_users_may_not(client, join_token, alice, alice_api, django_user_model):
    beat(client)
    host = Host.objects.get()
    assert alice_api.post(f"/api/hosts/{host.pk}/drain/").status_code == 403
    admin = client_for(django_user_model.objects.create_user("root", password="root-password-1", is_staff=True))
    assert admin.post(f"/api/hosts/{host.pk}/drain/").json()["status"] == "draining"
    assert admin.post(f"/api/hosts/{host.pk}/drain/").status_code == 409
    # A draining host's heartbeat keeps it draining.
    assert beat(client).json() == {"status": "draining"}
    assert admin.post(f"/api/hosts/{host.pk}/undrain/").json()["status"] == "ready"
    assert admin.post(f"/api/hosts/{host.pk}/undrain/").status_code == 409


def test_a_host_whose_heartbeats_stop_is_marked_lost_and_a_new_beat_brings_it_back(client, join_token, settings):
    settings.HOST_LOST_AFTER_SECONDS = 15
    beat(client, name="a")
    beat(client, name="b")
    Host.objects.filter(name="b").update(last_seen=timezone.now() - timedelta(seconds=16))
    assert watch_hosts() == ["b"]
    assert dict(Host.objects.values_list("name", "status")) == {"a": "ready", "b": "lost"}
    assert watch_hosts() == []  # marked once
    assert beat(client, name="b").json() == {"status": "ready"}


def test_once_a_host_has_joined_the_join_token_cannot_speak_for_it_nor_can_another_hosts_secret(
    client, join_token, caplog
):
    beat(client, name="a")
    beat(client, name="b", address="10.9.0.12")
    with caplog.at_level(logging.WARNING, logger="hosts.views"):
        taken = beat(client, name="a", token=TOKEN, address="10.9.0.66")
    assert taken.status_code == 403
    assert taken.json()["detail"].startswith("Host a has joined already and beats with its own secret")
    assert "join from 127.0.0.1 as host a refused" in caplog.text
    assert beat(client, name="a", token=host_secrets["b"], address="10.9.0.66").status_code == 401
    assert dict(Host.objects.values_list("name", "address")) == {"a": "10.9.0.11", "b": "10.9.0.12"}
    assert beat(client, name="a", address="10.9.0.13").json() == {"status": "ready"}  # its own secret
    assert Host.objects.get(name="a").address == "10.9.0.13"


def test_staff_remove_a_host_that_holds_no_device_and_a_machine_may_then_join_under_its_name(
    client, join_token, alice_api, django_user_model
):
    from hosts.models import DeviceClaim
    from runs.models import Run

    beat(client, name="a")
    host = Host.objects.get()
    admin = client_for(django_user_model.objects.create_user("root", password="root-password-1", is_staff=True))
    assert alice_api.post(f"/api/hosts/{host.pk}/remove/").status_code == 403
    run = Run.objects.create(owner=django_user_model.objects.get(username="alice"), name="r", spec={})
    claim = DeviceClaim.objects.create(host=host, device=0, run=run, node=0)
    held = admin.post(f"/api/hosts/{host.pk}/remove/")
    assert held.status_code == 409
    assert f"host a still holds devices for run {run.pk} node 0" in str(held.json())
    claim.delete()
    assert admin.post(f"/api/hosts/{host.pk}/remove/").status_code == 204
    assert not Host.objects.exists()
    assert beat(client, name="a").status_code == 401  # the old secret went with the host
    assert "host_secret" in beat(client, name="a", token=TOKEN).json()  # a machine joins under the name anew
