"""A run's checkpoint storage, against a real S3 server (moto's): a run is queued only if the storage
answers, a checkpoint on S3 counts as pruned once its marker is gone, and its export and uploaded datasets go to S3."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from deployments.models import Deployment
from deployments.options import export_info
from deployments.services import check_checkpoint
from deployments.tasks import reconcile_deployments
from runs import exports
from runs.models import Checkpoint, Dataset, Run
from serving.deployment_config import DeploymentConfig
from serving.export_store import local_copy
from serving.state import DeploymentDir
from tests.faults.harness import training_spec
from tests.platform.test_runs_api import ingest, token_for
from tools.check_parity import launch
from tools.s3_server import S3Server
from training.checkpoint_storage import StoredCheckpoints
from training.config import DataConfig
from training.run_dir import storage_checkpoints_url, storage_export_url
from training.storage import Storage, dataset_url

pytestmark = pytest.mark.django_db


def submit(api):
    return api.post("/api/runs/", {"name": "r", "recipe": "tiny"}, format="json")


def test_a_run_on_reachable_s3_is_queued_with_the_storage_in_its_spec(alice_api, s3: S3Server, settings) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    response = submit(alice_api)
    assert response.status_code == 201, response.json()
    assert Run.objects.get(pk=response.json()["id"]).spec["data"]["storage"] == "s3://fathom/cluster"


def test_a_run_is_refused_when_the_storage_credentials_are_wrong(
    alice_api, s3: S3Server, settings, monkeypatch
) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    response = submit(alice_api)
    assert response.status_code == 400
    (message,) = response.json()["storage"]
    assert "s3://fathom/cluster" in message and "access denied" in message
    assert not Run.objects.exists()


def test_a_run_is_refused_when_the_bucket_does_not_exist(alice_api, s3: S3Server, settings) -> None:
    settings.STORAGE_URL = "s3://no-such-bucket/cluster"
    response = submit(alice_api)
    assert response.status_code == 400
    (message,) = response.json()["storage"]
    assert "s3://no-such-bucket/cluster" in message and "bucket" in message and "does not exist" in message
    assert not Run.objects.exists()


def test_a_run_is_refused_when_the_storage_endpoint_does_not_answer(
    alice_api, s3: S3Server, settings, monkeypatch
) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # discard: nothing listens there
    response = alice_api.post("/api/runs/check/", {"name": "r", "recipe": "tiny"}, format="json")
    assert response.status_code == 400
    assert "the endpoint did not answer" in response.json()["storage"][0]


def test_a_user_cannot_choose_where_checkpoints_go(alice_api) -> None:
    response = alice_api.post(
        "/api/runs/", {"name": "r", "recipe": "tiny", "spec": {"data": {"storage": "s3://mine"}}}, format="json"
    )
    assert response.status_code == 400
    assert "FATHOM_STORAGE_URL" in response.json()["spec"]["data"]["storage"][0]


def test_a_checkpoint_on_s3_is_marked_pruned_once_its_marker_is_gone(client, alice_api, s3: S3Server, settings) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    run_id = submit(alice_api).json()["id"]
    stored = StoredCheckpoints(s3.url("cluster/runs/pruning/checkpoints"))
    for step in (10, 20):
        stored.fs.pipe_file(stored.path_of(step, "fathom.json"), b"{}")
        stored.commit(step)
    token = token_for(run_id)
    reported = [{"seq": i, "kind": "checkpoint", "data": {"step": step, "path": stored.url_of(step)}} for i, step in ((1, 10), (2, 20))]
    ingest(client, run_id, token, reported[:1])
    stored.remove(10)  # what rank 0 does when it prunes, before it reports the checkpoint that replaced it
    ingest(client, run_id, token, reported[1:])
    pruned = {c.step: c.pruned_at is not None for c in Checkpoint.objects.filter(run_id=run_id)}
    assert pruned == {10: True, 20: False}


@pytest.mark.slow
def test_a_checkpoint_on_s3_is_exported_to_s3_and_a_host_serves_a_checked_copy(
    alice_api, s3: S3Server, settings, tmp_path
) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    run = Run.objects.get(pk=submit(alice_api).json()["id"])
    spec = dataclasses.replace(training_spec(steps=2, checkpoint_interval=2, dp=1), data=DataConfig(storage=s3.url("cluster")))
    launch(spec, run.folder, timeout=600)
    checkpoints = StoredCheckpoints(storage_checkpoints_url(s3.url("cluster"), run.folder.name))
    checkpoint = Checkpoint.objects.create(run=run, step=2, path=checkpoints.url_of(2))
    check_checkpoint(checkpoint)  # deployable: its marker is on S3, though no folder is here
    assert export_info(checkpoint).max_position_embeddings == 32  # read from the spec on S3

    where = exports.export(checkpoint)
    assert where == storage_export_url(s3.url("cluster"), run.folder.name, 2)
    assert Checkpoint.objects.get(pk=checkpoint.pk).export_path == where
    assert not run.run_dir.exports_dir.exists() or not any(run.run_dir.exports_dir.iterdir())  # nothing kept here
    checkpoint.refresh_from_db()
    assert exports.export(checkpoint) == where  # whole already: not made again
    assert export_info(checkpoint).architectures == ("LlamaForCausalLM",)

    # What a serving host does before vLLM starts: a checked copy in its own cache, equal to an
    # export made from the checkpoint directly.
    copy = Path(local_copy(where, tmp_path / "host" / "cache"))
    subprocess.run([sys.executable, "-m", "training.export", checkpoints.url_of(2), str(tmp_path / "direct")], check=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (copy / name).read_bytes() == (tmp_path / "direct" / name).read_bytes(), name


def test_an_upload_goes_to_s3_named_by_its_checksum_and_a_run_names_that_object(
    alice_api, s3: S3Server, settings
) -> None:
    settings.STORAGE_URL = s3.url("cluster")
    text = b"a line of the corpus\n" * 50
    response = alice_api.post("/api/datasets/", {"file": SimpleUploadedFile("corpus.txt", text)}, format="multipart")
    assert response.status_code == 201, response.json()
    dataset = Dataset.objects.get(pk=response.json()["id"])
    assert dataset.path == dataset_url(s3.url("cluster"), hashlib.sha256(text).hexdigest(), "corpus.txt")
    assert dataset.sha256 == hashlib.sha256(text).hexdigest()
    stored = Storage.open(dataset.path)
    assert stored.fs.cat_file(stored.root) == text
    assert not any(settings.DATASETS_DIR.rglob("corpus.txt"))  # the control plane keeps no copy

    response = alice_api.post("/api/runs/", {"name": "r", "recipe": "tiny", "dataset": dataset.pk}, format="json")
    assert response.status_code == 201, response.json()
    assert Run.objects.get(pk=response.json()["id"]).spec["data"]["dataset"] == dataset.path
    # A user still cannot name an object (or a file) in a spec: only their dataset's id.
    response = alice_api.post(
        "/api/runs/", {"name": "x", "spec": {"data": {"dataset": dataset.path}}}, format="json"
    )
    assert response.status_code == 400

    stored.fs.rm_file(stored.root)
    response = alice_api.post("/api/runs/", {"name": "r", "recipe": "tiny", "dataset": dataset.pk}, format="json")
    assert response.status_code == 400
    assert response.json()["dataset"] == [
        f"the object of dataset {dataset.pk} (corpus.txt), {dataset.path}, is gone; upload it again"
    ]


def test_a_supervisor_that_cannot_download_its_export_fails_the_deployment_naming_the_object(
    alice, s3: S3Server, settings, tmp_path
) -> None:
    settings.DEPLOYMENTS_DIR = tmp_path / "deployments"
    run = Run.objects.create(owner=alice, name="source", spec={})
    torn = s3.url("cluster/runs/torn/exports/step_00000001")  # an upload that never wrote its manifest
    Storage.open(torn).fs.pipe_file(Storage.open(torn).path("config.json"), b"{}")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere", export_path=torn)
    deployment = Deployment.objects.create(
        owner=alice, name="d", checkpoint=checkpoint, served_model_name="torn", status=Deployment.Status.STARTING
    )
    config = DeploymentConfig(name="torn", export=torn, state_dir=str(deployment.folder), python=sys.executable)
    log = DeploymentDir(deployment.folder).supervisor_log
    log.parent.mkdir(parents=True)
    with log.open("wb") as out:
        supervisor = subprocess.Popen(
            [sys.executable, "-m", "serving.supervisor", "--config", str(config.write())],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    assert supervisor.wait(timeout=120) != 0
    Deployment.objects.filter(pk=deployment.pk).update(supervisor_pid=supervisor.pid)
    assert reconcile_deployments() == 1
    deployment.refresh_from_db()
    assert deployment.status == "failed"
    assert deployment.status_reason == (
        f"the replica supervisor exited: deployment torn: export {torn} cannot be served: it has no "
        "fathom-export.json (never finished uploading)"
    )
