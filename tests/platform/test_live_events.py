"""Websockets deliver committed events; a real Celery worker runs tasks on the embedded broker."""

from __future__ import annotations

import time

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django_celery_results.models import TaskResult
from rest_framework.authtoken.models import Token

from controlplane.asgi import application
from runs import services
from runs.models import Run
from runs.tasks import reconcile_runs


def _connect(user, run_id: int, query: str = "") -> WebsocketCommunicator:
    headers = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1")]
    if user is not None:
        headers.append((b"authorization", f"Token {Token.objects.get_or_create(user=user)[0].key}".encode()))
    return WebsocketCommunicator(application, f"/ws/runs/{run_id}/{query}", headers=headers)


@pytest.mark.django_db(transaction=True)
async def test_a_websocket_client_receives_an_event_after_its_transaction_commits(alice):
    run = await database_sync_to_async(Run.objects.create)(owner=alice, name="live", spec={})
    communicator = await database_sync_to_async(_connect)(alice, run.pk, "?after=0")
    connected, _ = await communicator.connect()
    assert connected

    def record() -> None:
        with transaction.atomic():
            services._record(run, "metrics", {"step": 1, "loss": 4.2})

    await database_sync_to_async(record)()
    message = await communicator.receive_json_from(timeout=5)
    assert message["type"] == "events"
    assert message["events"][0]["kind"] == "metrics"
    assert message["events"][0]["loss"] == 4.2
    await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_a_reconnecting_client_gets_exactly_what_it_missed(alice):
    run = await database_sync_to_async(Run.objects.create)(owner=alice, name="live", spec={})

    def record_many(n: int) -> None:
        for step in range(n):
            with transaction.atomic():
                services._record(run, "metrics", {"step": step})

    await database_sync_to_async(record_many)(5)
    communicator = await database_sync_to_async(_connect)(alice, run.pk)
    await communicator.connect()
    await communicator.send_json_to({"after": 3})
    message = await communicator.receive_json_from(timeout=5)
    assert [e["seq"] for e in message["events"]] == [4, 5]
    await communicator.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_another_users_run_or_no_login_is_refused(alice, bob):
    run = await database_sync_to_async(Run.objects.create)(owner=alice, name="private", spec={})
    for user in (bob, None):
        communicator = await database_sync_to_async(_connect)(user, run.pk)
        connected, code = await communicator.connect()
        assert not connected
        assert code == 4404


@pytest.mark.django_db(transaction=True)
def test_a_real_celery_worker_runs_a_task_from_the_embedded_broker(alice, celery_worker):
    # A run whose agent died (its lock file is left, held by nobody) is failed by the reconcile task.
    run = Run.objects.create(owner=alice, name="lost", spec={}, status=Run.Status.RUNNING, agent_pids=[2**22 + 7])
    run.folder.mkdir(parents=True)
    (run.folder / "agent-node0.lock").touch()
    result = reconcile_runs.delay()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not TaskResult.objects.filter(task_id=result.id, status="SUCCESS").exists():
        time.sleep(0.3)
    stored = TaskResult.objects.get(task_id=result.id)
    assert stored.status == "SUCCESS"
    assert stored.result == "1"
    run.refresh_from_db()
    assert run.status == "failed"
    assert "exited without reporting" in run.status_reason


@pytest.mark.django_db(transaction=True)
def test_reconcile_leaves_a_run_whose_agent_holds_its_lock_however_quiet(alice):
    import fcntl
    from datetime import timedelta

    from django.utils import timezone

    quiet = timezone.now() - timedelta(hours=1)
    run = Run.objects.create(owner=alice, name="slow steps", spec={}, status=Run.Status.RUNNING, last_report_at=quiet)
    run.folder.mkdir(parents=True)
    with (run.folder / "agent-node0.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the running agent's flock holds it
        assert reconcile_runs() == 0
    run.refresh_from_db()
    assert run.status == "running"
    assert reconcile_runs() == 1  # the lock is free: the agent is gone
    run.refresh_from_db()
    assert run.status == "failed"


@pytest.mark.django_db(transaction=True)
async def test_a_deployment_stream_replays_after_the_clients_seq_then_goes_live(alice):
    from deployments import services as deployment_services
    from deployments.models import Deployment
    from runs.models import Checkpoint

    def make() -> Deployment:
        run = Run.objects.create(owner=alice, name="served", spec={})
        checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
        deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d")
        for kind in ("created", "replica_starting", "replica_ready"):
            deployment_services.do_record(deployment, kind, {"replica": 0})
        return deployment

    deployment = await database_sync_to_async(make)()
    headers = [(b"origin", b"http://127.0.0.1"), (b"host", b"127.0.0.1"),
               (b"authorization", f"Token {(await database_sync_to_async(Token.objects.get_or_create)(user=alice))[0].key}".encode())]
    communicator = WebsocketCommunicator(application, f"/ws/deployments/{deployment.pk}/?after=1", headers=headers)
    assert (await communicator.connect())[0]
    replay = await communicator.receive_json_from(timeout=5)
    assert [e["kind"] for e in replay["events"]] == ["replica_starting", "replica_ready"]
    await database_sync_to_async(deployment_services.do_record)(deployment, "metrics", {"tokens_per_s": 12.5})
    live = await communicator.receive_json_from(timeout=5)
    assert [(e["seq"], e["kind"], e["tokens_per_s"]) for e in live["events"]] == [(4, "metrics", 12.5)]
    await communicator.disconnect()
