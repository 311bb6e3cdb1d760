"""A run and a deployment on namespace hosts whose data comes through S3 (moto's server on the
test's bridge), each host with a FATHOM_DATA_DIR of its own: the dataset, the checkpoints and
the export live on S3, and each host keeps its own checked copies in its own cache.

Neither a run nor a deployment needs anything of the control plane's folder: each host worker
(and all it starts: agents, ranks, supervisors, vLLM) runs in a mount namespace where that folder
is an empty tmpfs. A supervisor's config comes with its start task and its state, events and logs
go to the control plane over HTTP (serving.shipper).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import s3fs
from django.conf import settings

from deployments.models import Deployment
from runs.models import Checkpoint, Dataset, Run
from tests.platform.test_hosts_netns import TRAIN, Cluster, running_cluster, wait_finished
from tests.platform.test_run_lifecycle import wait_until
from tools import netns
from tools.s3_server import S3Server
from training.checkpoint_storage import is_committed_at
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
            s3fs.S3FileSystem.clear_instance_cache()  # this process's clients name a server now gone


@pytest.fixture
def s3_cluster_without_our_folder(
    s3_on_bridge, alice, transactional_db, tmp_path, monkeypatch
) -> Iterator[tuple[Cluster, S3Server]]:
    """As `s3_cluster`, with the control plane's data folder hidden from every host."""
    network, server = s3_on_bridge
    own = {index: {"FATHOM_DATA_DIR": str(host_data(tmp_path, index))} for index in range(2)}
    assert not tmp_path.is_relative_to(settings.DATA_DIR), "the hosts' own folders must stay visible to them"
    with running_cluster(
        network, alice, tmp_path, monkeypatch, host_env=lambda index: own[index], hidden=settings.DATA_DIR
    ) as cluster:
        yield cluster, server


def run_log(cluster: Cluster, run_id: int, rank: int) -> str:
    answer = cluster.api.get(f"/api/runs/{run_id}/logs/", params={"rank": rank, "lines": 400})
    assert answer.status_code == 200, answer.text
    return "\n".join(answer.json()["lines"])


def host_data(tmp_path: Path, index: int) -> Path:
    return tmp_path / f"host{index}-data"


def host_cache(tmp_path: Path, index: int) -> Path:
    return host_data(tmp_path, index) / "cache"


@pytest.mark.vllm
@pytest.mark.django_db(transaction=True)
def test_a_run_on_two_hosts_trains_checkpoints_and_exports_through_s3_and_a_host_serves_the_export(
    s3_cluster_without_our_folder, tmp_path
) -> None:
    # Neither the run's hosts nor the serving host see our data folder.
    cluster, server = s3_cluster_without_our_folder
    for host in cluster.hosts:
        assert host.process is not None and not netns.sees(host.process.pid, settings.DEPLOYMENTS_DIR)
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
        # The replica is ready on the deployment's page and API, with its host's address.
        (replica,) = cluster.api.get(f"/api/deployments/{deployment_id}/").json()["replica_set"]
        assert replica["status"] == "ready", replica
        assert replica["url"].startswith(f"http://{placed['address']}:"), replica
        # The supervisor's folder is its host's: the config came with the start task, and state,
        # events and logs are written there; ours is the copy its shipper sent.
        relative = (Deployment.objects.get(pk=deployment_id).folder / "hosts" / placed["host"]).relative_to(settings.DATA_DIR)
        own = host_data(tmp_path, serving) / relative
        ours = settings.DATA_DIR / relative
        assert json.loads((own / "deployment.json").read_text())["name"] == "from-s3"
        assert not (ours / "deployment.json").exists()
        assert (own / "events.jsonl").is_file() and (own / "logs" / "replica-0.log").is_file()
        assert '"replica_ready"' in (ours / "events.jsonl").read_text()
        # vLLM's log reaches the log API (the copy of the host's file).
        wait_until(
            lambda: any(
                "Application startup complete" in line
                for line in cluster.api.get(f"/api/deployments/{deployment_id}/logs/", params={"replica": 0, "lines": 2000}).json()["lines"]
            ),
            60, "the replica's log through the API",
        )  # fmt: skip
    finally:
        cluster.api.post(f"/api/deployments/{deployment_id}/stop/")
        wait_until(
            lambda: cluster.api.get(f"/api/deployments/{deployment_id}/").json()["status"] == "stopped", 180, "the stop"
        )
    # Stopped by a stop task to its host: the replica's stop reached us, and the host runs nothing.
    assert f"stopped deployment-{deployment_id} (pid" in cluster.hosts[serving].log.read_text()
    stopped = cluster.api.get(f"/api/deployments/{deployment_id}/").json()
    assert [r["status"] for r in stopped["replica_set"]] == ["stopped"], stopped
    wait_until(lambda: '"replica_stopped"' in (ours / "events.jsonl").read_text(), 60, "the replica_stopped event")
    wait_until(
        lambda: all(not h["running"] for h in cluster.api.get("/api/hosts/").json()["results"]), 60, "both hosts idle"
    )
    assert Run.objects.get(pk=run.pk).status == "succeeded"


@pytest.mark.django_db(transaction=True)
def test_a_run_on_two_hosts_that_cannot_see_the_control_planes_folder_trains_exports_and_is_cancelled(
    s3_cluster_without_our_folder, tmp_path
) -> None:
    cluster, server = s3_cluster_without_our_folder
    for index, host in enumerate(cluster.hosts):
        assert host.process is not None
        # The host worker's view: our data folder is an empty tmpfs; its own folder is there.
        assert netns.sees(host.process.pid, settings.DATA_DIR)
        assert not netns.sees(host.process.pid, settings.RUNS_DIR)
        assert netns.sees(host.process.pid, host_cache(tmp_path, index).parent)
    corpus = demo_corpus.write(tmp_path / "corpus.txt", n_documents=2000).read_bytes()
    uploaded = cluster.api.post("/api/datasets/", files={"file": ("corpus.txt", corpus)})
    assert uploaded.status_code == 201, uploaded.text
    dataset = uploaded.json()["id"]

    spec = {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN}
    submitted = cluster.api.post("/api/runs/", json={"name": "no folder", "dataset": dataset, "spec": spec})
    assert submitted.status_code == 201, submitted.text
    run = wait_finished(submitted.json()["id"])
    assert run.status == "succeeded", run.status_reason
    nodes = {n["node"]: int(n["host"][1:]) for n in run.events.get(kind="placed").data["nodes"]}
    assert sorted(nodes.values()) == [0, 1]
    prefix = f"{server.url('cluster')}/runs/{run.folder.name}/checkpoints/"
    assert [(c.step, c.path.startswith(prefix)) for c in run.checkpoints.all()] == [(2, True), (4, True)]
    wait_until(lambda: Checkpoint.objects.get(run=run, step=4).export_path, 600, "the export")
    assert Checkpoint.objects.get(run=run, step=4).export_path.startswith(f"{server.url('cluster')}/runs/")
    # Each host kept the run's folder under its own data folder: the spec came with the start
    # task, and its agent's log, lock and event spool are there, not in ours.
    for node, index in nodes.items():
        own = RunDir(host_data(tmp_path, index) / "runs" / run.folder.name)
        assert json.loads(own.spec_file.read_text()) == run.spec
        assert "succeeded" in own.agent_log(node).read_text()
        assert own.agent_lock(node).exists() and own.node(node).spool_file.exists()
        assert not run.run_dir.agent_lock(node).exists() and not run.run_dir.node(node).path.exists()
    # Their logs came to us: the log API shows each rank's, and our copy of every rank's log is
    # its host's file, byte for byte.
    wait_until(lambda: "finished step 4" in run_log(cluster, run.pk, 0), 60, "rank 0's log through the API")
    assert "checkpoint step 4 committed at s3://" in run_log(cluster, run.pk, 0)
    assert "fathom: rank 1 starting" in run_log(cluster, run.pk, 1)
    for index in (0, 1):
        own = RunDir(host_data(tmp_path, index) / "runs" / run.folder.name)
        (rank_log,) = own.logs_dir.glob("rank*.log")
        copy = run.run_dir.logs_dir / rank_log.name
        # (An agent ships its last lines as it exits, after its final event.)
        wait_until(lambda a=copy, b=rank_log: a.exists() and a.read_bytes() == b.read_bytes(), 60, f"our copy of {rank_log}")
    for node in (0, 1):
        wait_until(
            lambda node=node: "succeeded" in run.run_dir.agent_log(node).read_text(errors="replace"),
            60, f"node {node}'s agent log saying it succeeded",
        )  # fmt: skip

    # A cancel is a stop task to each host (SIGTERM to its agent): no marker is written anywhere.
    long = {**spec, "train": {**TRAIN, "steps": 400}}
    submitted = cluster.api.post("/api/runs/", json={"name": "cancelled", "dataset": dataset, "spec": long})
    assert submitted.status_code == 201, submitted.text
    long_id = submitted.json()["id"]
    wait_until(lambda: Run.objects.get(pk=long_id).checkpoints.exists(), 600, "the long run's first checkpoint")
    assert cluster.api.post(f"/api/runs/{long_id}/cancel/").status_code == 200
    cancelled = wait_finished(long_id, timeout=180)
    assert cancelled.status == "cancelled", cancelled.status_reason
    # The run is cancelled at the first node's report; the other's comes once its agent has
    # stopped its ranks (they save first), a moment later.
    ends = cancelled.events.filter(kind__in=["succeeded", "failed", "cancelled"])
    wait_until(lambda: ends.count() >= 2, 60, "both nodes' end events")
    outcomes = sorted(ends.values_list("source", "kind"))
    assert outcomes == [("node-0", "cancelled"), ("node-1", "cancelled")]
    placed = {n["node"]: int(n["host"][1:]) for n in cancelled.events.get(kind="placed").data["nodes"]}
    for node, index in placed.items():
        assert f"stopped run-{long_id}-node-{node} (pid" in cluster.hosts[index].log.read_text()
        assert not (host_data(tmp_path, index) / "runs" / cancelled.folder.name / "cancel").exists()
    assert not cancelled.run_dir.cancel_marker.exists()
    for node in (0, 1):
        wait_until(
            lambda node=node: "cancelled" in cancelled.run_dir.agent_log(node).read_text(errors="replace"),
            60, f"node {node}'s agent log saying it cancelled",
        )  # fmt: skip
    # The newest checkpoint the agents reported is committed on S3, and the hosts run nothing more.
    latest = cancelled.checkpoints.order_by("-step").first()
    assert latest is not None and latest.path.startswith(server.url("cluster"))
    assert is_committed_at(latest.path)
    wait_until(
        lambda: all(not h["running"] for h in cluster.api.get("/api/hosts/").json()["results"]), 60, "both hosts idle"
    )
