"""A run and a deployment on namespace hosts whose data comes through S3 (moto's server on the
test's bridge), each host with a FATHOM_DATA_DIR of its own: the dataset, the checkpoints and
the export live on S3, and each host keeps its own checked copies in its own cache.

What the hosts still take from the control plane's folder, by the absolute paths it passes
(these namespaces share the machine's filesystem, so the test cannot hide it): the run's spec
file, its run folder (events spool, logs, agent locks, cancel marker) and the deployment's
folder (supervisor config, state and events files, replica logs). docs/ARCHITECTURE.md lists them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import s3fs

from runs.models import Checkpoint, Dataset, Run
from tests.platform.test_hosts_netns import TRAIN, Cluster, running_cluster, wait_finished
from tests.platform.test_run_lifecycle import wait_until
from tools import netns
from tools.s3_server import S3Server
from training.demo import corpus as demo_corpus
from training.run_dir import RunDir

pytestmark = pytest.mark.slow


@pytest.fixture
def s3_on_bridge(tmp_path: Path, monkeypatch) -> Iterator[tuple[netns.Network, S3Server]]:
    with netns.network() as network:
        server = S3Server(log_file=tmp_path / "moto.log", host=network.bridge_address)
        server.start()
        try:
            # Every process the cluster starts (web, worker, host workers, agents, ranks,
            # supervisors) reaches S3 at the bridge with these; this process too.
            for name, value in server.env().items():
                monkeypatch.setenv(name, value)
            monkeypatch.setenv("FATHOM_STORAGE_URL", server.url("cluster"))
            s3fs.S3FileSystem.clear_instance_cache()
            yield network, server
        finally:
            server.stop()


@pytest.fixture
def s3_cluster(s3_on_bridge, alice, transactional_db, tmp_path, monkeypatch) -> Iterator[tuple[Cluster, S3Server]]:
    network, server = s3_on_bridge
    own = {index: {"FATHOM_DATA_DIR": str(tmp_path / f"host{index}-data")} for index in range(2)}
    with running_cluster(network, alice, tmp_path, monkeypatch, host_env=lambda index: own[index]) as cluster:
        yield cluster, server


def host_cache(tmp_path: Path, index: int) -> Path:
    return tmp_path / f"host{index}-data" / "cache"


@pytest.mark.vllm
@pytest.mark.django_db(transaction=True)
def test_a_run_on_two_hosts_trains_checkpoints_and_exports_through_s3_and_a_host_serves_the_export(
    s3_cluster, tmp_path
) -> None:
    cluster, server = s3_cluster
    corpus = demo_corpus.write(tmp_path / "corpus.txt", n_documents=2000).read_bytes()
    sha = hashlib.sha256(corpus).hexdigest()
    uploaded = cluster.api.post("/api/datasets/", files={"file": ("corpus.txt", corpus)})
    assert uploaded.status_code == 201, uploaded.text
    dataset = Dataset.objects.get(pk=uploaded.json()["id"])
    assert dataset.path == f"{server.url('cluster')}/datasets/{sha}/corpus.txt"

    spec = {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN}
    submitted = cluster.api.post("/api/runs/", json={"name": "on s3", "dataset": dataset.pk, "spec": spec})
    assert submitted.status_code == 201, submitted.text
    run = wait_finished(submitted.json()["id"])
    assert run.status == "succeeded", run.status_reason
    assert sorted(n["host"] for n in run.events.get(kind="placed").data["nodes"]) == ["h0", "h1"]

    # Each host read the dataset from its own checked copy, downloaded from S3.
    for index in (0, 1):
        assert (host_cache(tmp_path, index) / "datasets" / sha / "corpus.txt").read_bytes() == corpus
    # The checkpoints are on S3 only.
    prefix = f"{server.url('cluster')}/runs/{run.folder.name}/checkpoints/"
    assert [(c.step, c.path.startswith(prefix)) for c in run.checkpoints.all()] == [(2, True), (4, True)]
    assert not RunDir(run.folder).checkpoints_dir.exists()

    # The final checkpoint's export goes to S3 next to it, never into the run folder.
    wait_until(lambda: Checkpoint.objects.get(run=run, step=4).export_path, 600, "the export")
    export_url = Checkpoint.objects.get(run=run, step=4).export_path
    assert export_url == f"{server.url('cluster')}/runs/{run.folder.name}/exports/step_00000004"
    assert not RunDir(run.folder).exports_dir.exists() or not any(RunDir(run.folder).exports_dir.iterdir())

    options = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}
    checkpoint_id = Checkpoint.objects.get(run=run, step=4).pk
    body = {"checkpoint": checkpoint_id, "replicas": 1, "options": options, "served_model_name": "from-s3"}
    created = cluster.api.post("/api/deployments/", json=body)
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    try:
        wait_until(
            lambda: cluster.api.get(f"/api/deployments/{deployment_id}/").json()["status"] in ("ready", "failed"),
            900, "a ready replica",
        )  # fmt: skip
        deployment = cluster.api.get(f"/api/deployments/{deployment_id}/").json()
        assert deployment["status"] == "ready", deployment
        events = cluster.api.get(f"/api/deployments/{deployment_id}/events/").json()
        (placed,) = next(e["data"]["hosts"] for e in events if e["kind"] == "placed")
        serving = int(placed["host"][1:])
        # The serving host downloaded the export into its own cache before vLLM started; the
        # other host has none.
        (copy,) = (host_cache(tmp_path, serving) / "exports").iterdir()
        assert (copy / "model.safetensors").is_file() and (copy / "config.json").is_file()
        assert not (host_cache(tmp_path, 1 - serving) / "exports").exists()
        key = cluster.api.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "t"}).json()["key"]
        chat = httpx.post(
            f"{cluster.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
            json={"model": "from-s3", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 5},
        )  # fmt: skip
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] is not None
    finally:
        cluster.api.post(f"/api/deployments/{deployment_id}/stop/")
        wait_until(
            lambda: cluster.api.get(f"/api/deployments/{deployment_id}/").json()["status"] == "stopped", 180, "the stop"
        )
    assert Run.objects.get(pk=run.pk).status == "succeeded"
