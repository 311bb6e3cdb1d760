"""A supervisor on a host that keeps its folder to itself ships it to the control plane: a real
`serving.shipper.FolderShipper` against a real web process. Our copy (hosts/<host>/ of the
deployment folder) is what sync, the routers and the log API read: the state whole, the events
and logs once each whatever is sent again; a supervisor sharing our folder ships nothing."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest

from deployments import supervision
from deployments.models import Deployment, Replica
from deployments.shipped import supervisor_token
from hosts.models import DeviceClaim, Host
from runs.models import Checkpoint, Run
from serving.shipper import FolderShipper, ShipperConfig
from serving.state import DeploymentDir, DeploymentState, ReplicaEvent, ReplicaState, append_event, write_state


def make_deployment(owner) -> Deployment:
    run = Run.objects.create(owner=owner, name="source", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(
        owner=owner, name="d", checkpoint=checkpoint, served_model_name="shipped", status=Deployment.Status.STARTING
    )
    Replica.objects.create(deployment=deployment, index=0)
    return deployment


def write(folder: DeploymentDir, phase: str, stopping: bool = False) -> None:
    replica = ReplicaState(index=0, phase=phase, port=9, pid=123, url="http://127.0.0.1:9")  # type: ignore[arg-type]
    state = DeploymentState(deployment="shipped", supervisor_pid=100, updated_at=time.time(), stopping=stopping, replicas=[replica])
    folder.logs_dir.mkdir(parents=True, exist_ok=True)
    write_state(folder, state)


def ship(url: str, deployment: Deployment, folder: DeploymentDir) -> FolderShipper:
    """One supervisor's life: start shipping, stop, ship the rest."""
    config = ShipperConfig(url=url, token=supervisor_token(deployment.pk, "h0"), host="h0", folder=folder, poll_interval=0.2)
    shipper = FolderShipper(config)
    shipper.start()
    assert shipper.close(timeout=30), shipper.last_error
    return shipper


def post(url: str, token: str, **piece: object) -> httpx.Response:
    body = {"host": "h0", "probe": "none", "file": "supervisor.log", "offset": 0, "chunk": "", **piece}
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.django_db(transaction=True)
def test_a_hosts_supervisor_folder_reaches_our_copy_which_sync_and_the_log_api_read(
    alice, alice_api, live_web, tmp_path: Path
) -> None:
    host = Host.objects.create(name="h0", address="10.0.0.5", devices=[{"index": 0, "kind": "cpu"}])
    deployment = make_deployment(alice)
    DeviceClaim.objects.create(host=host, device=0, deployment=deployment, node=0)  # its replica 0 runs there
    url = f"{live_web.url}/api/deployments/{deployment.pk}/shipped/"
    on_host = DeploymentDir(tmp_path / "host-data" / "deployments" / deployment.folder.name / "hosts" / "h0")
    ours = DeploymentDir(deployment.folder).on_host("h0")
    write(on_host, "ready")
    append_event(on_host, ReplicaEvent(kind="replica_ready", deployment="shipped", replica=0, at=time.time(), port=9))
    # More than two pieces (256 KiB each), and bytes that are not text.
    on_host.replica_log(0).write_bytes(bytes(range(256)) * 2100 + b"\nApplication startup complete.\n")
    on_host.supervisor_log.write_text("supervisor started\n")
    ship(url, deployment, on_host)
    for name in ("state.json", "events.jsonl", "supervisor.log", "logs/replica-0.log"):
        assert (ours.path / name).read_bytes() == (on_host.path / name).read_bytes(), name
    assert not ours.config_file.exists()

    # Sync reads our copy: the replica is ready, so is the deployment, and the event is stored once.
    supervision.sync(deployment)
    supervision.sync(deployment)
    assert Replica.objects.get(deployment=deployment).status == Replica.Status.READY
    assert Deployment.objects.get(pk=deployment.pk).status == Deployment.Status.READY
    assert list(deployment.events.filter(kind="replica_ready").values_list("data__port", flat=True)) == [9]
    lines = alice_api.get(f"/api/deployments/{deployment.pk}/logs/", {"replica": 0, "lines": 2000}).json()["lines"]
    assert lines[-1] == "Application startup complete."

    # The supervisor starts again there and stops: the new state replaces ours, the logs and
    # events get only what they gained.
    write(on_host, "stopped", stopping=True)
    append_event(on_host, ReplicaEvent(kind="replica_stopped", deployment="shipped", replica=0, at=time.time()))
    with on_host.replica_log(0).open("ab") as log:
        log.write(b"Shutting down\n")
    ship(url, deployment, on_host)
    for name in ("state.json", "events.jsonl", "logs/replica-0.log"):
        assert (ours.path / name).read_bytes() == (on_host.path / name).read_bytes(), name
    supervision.sync(deployment)
    assert Replica.objects.get(deployment=deployment).status == Replica.Status.STOPPED
    assert deployment.events.filter(kind="replica_stopped").count() == 1

    # A piece sent again or past what we hold changes nothing; both answer our end.
    held = ours.supervisor_log.stat().st_size
    again = post(url, supervisor_token(deployment.pk, "h0"), chunk=base64.b64encode(b"supervisor").decode())
    gap = post(url, supervisor_token(deployment.pk, "h0"), offset=held + 5, chunk=base64.b64encode(b"lost?").decode())
    assert (again.status_code, again.json(), gap.json()) == (200, {"offset": held}, {"offset": held})
    assert ours.supervisor_log.stat().st_size == held

    # Bad pieces are refused, naming why; another deployment's token is no token, nor is the
    # token of this deployment's supervisor on another host (no host speaks for another).
    token = supervisor_token(deployment.pk, "h0")
    assert post(url, supervisor_token(deployment.pk + 1, "h0")).status_code == 401
    Host.objects.create(name="h1", address="10.0.0.6", devices=[{"index": 0, "kind": "cpu"}])
    assert post(url, supervisor_token(deployment.pk, "h1")).status_code == 401
    wrong_name = post(url, token, file="../deployment.json")
    assert wrong_name.status_code == 400 and "file" in wrong_name.json()
    unknown_host = post(url, supervisor_token(deployment.pk, "../../elsewhere"), host="../../elsewhere")
    assert unknown_host.status_code == 400 and "host" in unknown_host.json()
    bad_state = post(url, token, file="state.json", chunk=base64.b64encode(b"{}").decode())
    assert bad_state.status_code == 400 and "chunk" in bad_state.json()
    assert post(url, token, chunk="not base64!").json() == {"chunk": ["must be base64"]}
    assert DeploymentState.from_dict(json.loads(ours.state_file.read_text())).replicas[0].phase == "stopped"

    # Once the deployment holds nothing on h0 (the host was lost), a supervisor that ran on
    # there is refused: its state would route requests to a replica that is being stopped.
    DeviceClaim.objects.filter(host=host, deployment=deployment).delete()
    write(on_host, "ready")
    refused = post(url, token, file="state.json", chunk=base64.b64encode(on_host.state_file.read_bytes()).decode())
    assert refused.status_code == 409 and "holds no device" in refused.json()["host"][0], refused.text
    assert DeploymentState.from_dict(json.loads(ours.state_file.read_text())).replicas[0].phase == "stopped"


@pytest.mark.django_db(transaction=True)
def test_a_supervisor_that_writes_into_our_own_folder_ships_nothing(alice, live_web) -> None:
    Host.objects.create(name="h0", address="127.0.0.1")
    deployment = make_deployment(alice)
    ours = DeploymentDir(deployment.folder).on_host("h0")
    write(ours, "ready")
    ours.supervisor_log.write_text("supervisor started\n")
    shipper = ship(f"{live_web.url}/api/deployments/{deployment.pk}/shipped/", deployment, ours)
    assert shipper.shared
    assert ours.supervisor_log.read_text() == "supervisor started\n"
    assert not ours.shipped_file.exists()
