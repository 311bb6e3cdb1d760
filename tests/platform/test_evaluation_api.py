"""Held-out evaluation through the API: the run body's validation settings, eval losses stored
per checkpoint from the agent's events, and checkpoint lists sorted by them ("deploy the best")."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from launch import run_agents
from runs.models import Checkpoint, Dataset, Run

pytestmark = pytest.mark.django_db


def upload(api, name: str = "held-out.txt") -> Dataset:
    response = api.post(
        "/api/datasets/", {"file": SimpleUploadedFile(name, b"words the model never trains on\n" * 50)}, format="multipart"
    )
    assert response.status_code == 201, response.content
    return Dataset.objects.get(pk=response.json()["id"])


@pytest.fixture
def run(alice) -> Run:
    return Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.RUNNING, token_launch=1)


def ingest(client, run: Run, events: list[dict]) -> None:
    body = {"source": "node-0", "events": [{"seq": i, "time": 1.0e9 + i, **e} for i, e in enumerate(events, 1)]}
    response = client.post(
        f"/api/runs/{run.pk}/events/",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {run_agents.node_token(run.pk, 1, 0)}",
    )
    assert response.status_code == 200, response.content


def checkpoint(step: int, eval_loss: float | None = None) -> dict:
    data: dict = {"step": step, "path": f"/runs/r/checkpoints/step_{step:08d}"}
    if eval_loss is not None:
        data["eval_loss"] = eval_loss
    return {"kind": "checkpoint", "data": data}


def test_checkpoints_keep_their_eval_loss_and_sort_by_it_best_first(client, alice_api, run):
    ingest(
        client,
        run,
        [
            checkpoint(10, 3.5),
            checkpoint(20, 2.75),
            checkpoint(25),  # saved between evaluations
            checkpoint(30),
            # its evaluation arriving after the checkpoint (a resume reports a checkpoint again)
            {"kind": "eval", "data": {"step": 30, "eval_loss": 3.0, "eval_perplexity": 20.1}},
        ],
    )
    assert dict(Checkpoint.objects.values_list("step", "eval_loss")) == {10: 3.5, 20: 2.75, 25: None, 30: 3.0}
    for url in (f"/api/runs/{run.pk}/checkpoints/", "/api/checkpoints/"):
        response = alice_api.get(url, {"ordering": "eval_loss"})
        assert response.status_code == 200, response.content
        rows = response.json()
        rows = rows["results"] if isinstance(rows, dict) else rows
        assert [(c["step"], c["eval_loss"]) for c in rows] == [(20, 2.75), (30, 3.0), (10, 3.5), (25, None)]
    worst_first = alice_api.get(f"/api/runs/{run.pk}/checkpoints/", {"ordering": "-eval_loss"}).json()
    assert [c["step"] for c in worst_first] == [10, 30, 20, 25]


@pytest.mark.parametrize("ordering", ["path", ""])
def test_an_unknown_checkpoint_ordering_is_refused_naming_the_allowed_ones(alice_api, run, ordering):
    for url in (f"/api/runs/{run.pk}/checkpoints/", "/api/checkpoints/"):
        response = alice_api.get(url, {"ordering": ordering})
        assert response.status_code == 400
        message = json.dumps(response.json())
        assert "ordering" in message and "eval_loss" in message


def test_an_eval_interval_without_held_out_data_is_refused_naming_the_field(alice_api):
    response = alice_api.post("/api/runs/", {"spec": {"train": {"eval_interval": 5}}}, format="json")
    assert response.status_code == 400
    assert "eval_interval" in json.dumps(response.json())
    assert Run.objects.count() == 0


def test_a_validation_fraction_is_kept_in_the_stored_spec_and_in_a_clone(alice_api):
    body = {"spec": {"train": {"eval_interval": 5}, "data": {"validation_fraction": 0.1}}}
    response = alice_api.post("/api/runs/", body, format="json")
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.spec["data"]["validation_fraction"] == 0.1
    assert run.spec["train"]["eval_interval"] == 5
    clone = alice_api.post(f"/api/runs/{run.pk}/clone/", {}, format="json")
    assert clone.status_code == 201, clone.content
    assert Run.objects.get(pk=clone.json()["id"]).spec["data"]["validation_fraction"] == 0.1


def test_a_validation_dataset_is_one_of_the_owners_datasets_resolved_to_its_file(alice_api, bob_api):
    held_out = upload(alice_api)
    body = {"validation_dataset": held_out.pk, "spec": {"train": {"eval_interval": 5}}}
    response = alice_api.post("/api/runs/", body, format="json")
    assert response.status_code == 201, response.content
    run = Run.objects.get(pk=response.json()["id"])
    assert run.validation_dataset == held_out
    assert run.spec["data"]["validation_dataset"] == held_out.path
    refused = bob_api.post("/api/runs/", body, format="json")
    assert refused.status_code == 400
    assert "validation_dataset" in refused.json()


def test_a_server_path_as_validation_dataset_is_refused(alice_api):
    response = alice_api.post("/api/runs/", {"spec": {"data": {"validation_dataset": "/etc/passwd"}}}, format="json")
    assert response.status_code == 400
    assert "server paths are not accepted" in json.dumps(response.json())


def test_a_validation_dataset_and_a_fraction_together_are_refused(alice_api):
    held_out = upload(alice_api)
    body = {"validation_dataset": held_out.pk, "spec": {"data": {"validation_fraction": 0.1}}}
    response = alice_api.post("/api/runs/", body, format="json")
    assert response.status_code == 400
    assert "validation_fraction" in json.dumps(response.json())
