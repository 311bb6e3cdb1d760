"""A deployment's status moves through `deployments.services.do_set_status` only: each move is
stored with the event that announces it, and a move the state no longer allows records nothing."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
from unittest import mock

import pytest
from django.db import connection

from deployments import supervision
from deployments.models import Deployment, Replica
from deployments.tasks import reconcile_deployments
from runs.models import Checkpoint, Run
from serving.state import DeploymentDir, DeploymentState, ReplicaEvent, ReplicaState, append_event

pytestmark = pytest.mark.django_db


def make_deployment(owner, status: str, **fields) -> Deployment:
    run = Run.objects.create(owner=owner, name="source", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    return Deployment.objects.create(
        owner=owner, name="d", checkpoint=checkpoint, served_model_name=f"d-{status}", status=status, **fields
    )


def kinds(deployment: Deployment) -> list[str]:
    return list(deployment.events.order_by("seq").values_list("kind", flat=True))


def test_a_deployment_whose_supervisor_is_gone_fails_once_with_its_reason(alice):
    gone = subprocess.Popen(["true"])
    gone.wait()
    deployment = make_deployment(alice, Deployment.Status.READY, supervisor_pid=gone.pid)
    assert reconcile_deployments() == 1
    deployment.refresh_from_db()
    assert (deployment.status, deployment.status_reason) == ("failed", "the replica supervisor exited")
    assert deployment.events.get(kind="failed").data == {"reason": "the replica supervisor exited"}
    assert reconcile_deployments() == 0 and kinds(deployment) == ["failed"]


def test_sync_marks_a_deployment_ready_with_one_status_event_when_every_replica_is(alice, settings, tmp_path):
    settings.DEPLOYMENTS_DIR = tmp_path
    deployment = make_deployment(alice, Deployment.Status.STARTING)
    Replica.objects.create(deployment=deployment, index=0)
    deployment.folder.mkdir(parents=True)
    state = DeploymentState(
        deployment=deployment.served_model_name, supervisor_pid=1, updated_at=0.0, stopping=False,
        # Nothing listens there: the metrics scrape finds no replica and says so.
        replicas=[ReplicaState(index=0, phase="ready", url="http://127.0.0.1:9", port=9, pid=1)],
    )  # fmt: skip
    (deployment.folder / "state.json").write_text(json.dumps(dataclasses.asdict(state)))

    supervision.sync(deployment)
    supervision.sync(deployment)  # nothing changed: no second status event

    deployment.refresh_from_db()
    assert deployment.status == "ready"
    status_events = list(deployment.events.filter(kind="status").values_list("data", flat=True))
    assert status_events == [{"status": "ready", "ready": 1, "replicas": 1}]
    assert Replica.objects.get(deployment=deployment).status == "ready"


@pytest.mark.django_db(transaction=True)
def test_overlapping_syncs_store_each_replica_event_once(alice, settings, tmp_path):
    # The periodic sync and a stop's sync may run at once, in two worker processes.
    settings.DEPLOYMENTS_DIR = tmp_path
    deployment = make_deployment(alice, Deployment.Status.STARTING)
    folder = DeploymentDir(deployment.folder)
    folder.path.mkdir(parents=True)
    for index in range(3):
        append_event(folder, ReplicaEvent(kind="replica_starting", deployment="d", replica=index, at=0.0))
    together = threading.Barrier(4)

    def sync() -> None:
        try:
            together.wait()
            supervision.sync(Deployment.objects.get(pk=deployment.pk))
        finally:
            connection.close()

    syncs = [threading.Thread(target=sync) for _ in range(4)]
    for thread in syncs:
        thread.start()
    for thread in syncs:
        thread.join()
    append_event(folder, ReplicaEvent(kind="replica_ready", deployment="d", replica=0, at=1.0))
    supervision.sync(deployment)

    stored = list(deployment.events.order_by("seq").values_list("kind", "data__replica"))
    assert stored == [("replica_starting", 0), ("replica_starting", 1), ("replica_starting", 2), ("replica_ready", 0)]


def test_stopping_a_stopped_deployment_is_refused_and_records_nothing(alice, alice_api):
    deployment = make_deployment(alice, Deployment.Status.STOPPED)
    response = alice_api.post(f"/api/deployments/{deployment.pk}/stop/")
    assert response.status_code == 409
    assert response.json() == {"status": ["only active or failed deployments can be stopped; this one is stopped"]}
    assert kinds(deployment) == []


def test_a_replica_that_gave_up_starting_fails_its_deployment_with_its_error_line_and_stops_it(
    alice, alice_api, settings, tmp_path
):
    # What a supervisor writes when a replica died the same way at two starts (the supervisor's
    # side, with a real vLLM, is tests/serving/test_quantized_export.py); a process stands in
    # for the supervisor, to be told to stop.
    settings.DEPLOYMENTS_DIR = tmp_path
    supervisor = subprocess.Popen(["sleep", "60"])
    try:
        deployment = make_deployment(alice, Deployment.Status.STARTING, supervisor_pid=supervisor.pid)
        Replica.objects.create(deployment=deployment, index=0)
        folder = DeploymentDir(deployment.folder)
        folder.path.mkdir(parents=True)
        why = (
            "failed the same way at 2 starts in a row (answered /health but generated no token within 60 s; "
            "killed. exit code -9): RuntimeError: Worker failed with error 'int8_scaled_mm_with_quant: expect A to "
            "be bfloat16 or half.'"
        )
        state = DeploymentState(
            deployment=deployment.served_model_name, supervisor_pid=supervisor.pid, updated_at=0.0, stopping=False,
            replicas=[ReplicaState(index=0, phase="failed", restarts=1, last_exit_code=-9)],
        )  # fmt: skip
        folder.state_file.write_text(json.dumps(dataclasses.asdict(state)))
        for kind in ("replica_starting", "replica_died", "replica_restarting", "replica_starting", "replica_died"):
            append_event(folder, ReplicaEvent(kind=kind, deployment="d", replica=0, at=0.0))  # type: ignore[arg-type]
        append_event(folder, ReplicaEvent(kind="replica_failed", deployment="d", replica=0, at=1.0, exit_code=-9, message=why))

        supervision.sync(deployment)

        shown = alice_api.get(f"/api/deployments/{deployment.pk}/").json()
        assert (shown["status"], shown["status_reason"]) == ("failed", f"replica 0 could not start: {why}")
        assert kinds(deployment)[-2:] == ["replica_failed", "failed"]
        assert Replica.objects.get(deployment=deployment).status == "dead"
        assert supervisor.wait(timeout=10) == -15  # told to stop what still runs (SIGTERM)
        supervision.sync(deployment)  # a later sync changes nothing
        assert kinds(deployment).count("failed") == 1
    finally:
        supervisor.kill()
        supervisor.wait()


def test_a_failed_deployment_can_be_stopped_so_what_survived_of_it_is_stopped(alice, alice_api, django_capture_on_commit_callbacks):
    deployment = make_deployment(alice, Deployment.Status.FAILED)
    with mock.patch("controlplane.queue.app.send_task") as send_task:
        with django_capture_on_commit_callbacks(execute=True):
            response = alice_api.post(f"/api/deployments/{deployment.pk}/stop/")
    assert response.status_code == 200
    assert Deployment.objects.get(pk=deployment.pk).status == Deployment.Status.STOPPING
    assert kinds(deployment) == ["stopping"]
    # The stop task, which asks every reachable host to stop its supervisor.
    send_task.assert_called_once_with("deployments.tasks.stop_deployment", args=(deployment.pk,))
