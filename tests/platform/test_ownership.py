"""A user never sees or changes another user's objects: every such request answers 404."""

from __future__ import annotations

import pytest

from deployments.models import ApiKey, Deployment
from runs.models import Checkpoint, Dataset, Run

pytestmark = pytest.mark.django_db


@pytest.fixture
def alices_things(alice, tmp_path):
    dataset_file = tmp_path / "a.txt"
    dataset_file.write_text("hello\n")
    dataset = Dataset.objects.create(owner=alice, name="a", format="text", path=str(dataset_file), records=1)
    run = Run.objects.create(owner=alice, name="alice's run", spec={"layout": {"dp": 1}})
    checkpoint = Checkpoint.objects.create(run=run, step=10, path="/tmp/ckpt")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="alice-model")
    ApiKey.issue(deployment)
    return {"dataset": dataset, "run": run, "checkpoint": checkpoint, "deployment": deployment}


def test_bob_gets_404_on_every_endpoint_of_alices_objects(bob_api, alice_api, alices_things):
    run, dataset = alices_things["run"], alices_things["dataset"]
    checkpoint, deployment = alices_things["checkpoint"], alices_things["deployment"]
    requests = [
        ("get", f"/api/runs/{run.pk}/"),
        ("post", f"/api/runs/{run.pk}/cancel/"),
        ("post", f"/api/runs/{run.pk}/resume/"),
        ("post", f"/api/runs/{run.pk}/clone/"),
        ("get", f"/api/runs/{run.pk}/checkpoints/"),
        ("get", f"/api/runs/{run.pk}/logs/"),
        ("get", f"/api/runs/{run.pk}/events/"),
        ("get", f"/api/datasets/{dataset.pk}/"),
        ("get", f"/api/checkpoints/{checkpoint.pk}/"),
        ("get", f"/api/deployments/{deployment.pk}/"),
        ("post", f"/api/deployments/{deployment.pk}/stop/"),
        ("get", f"/api/deployments/{deployment.pk}/events/"),
        ("get", f"/api/deployments/{deployment.pk}/keys/"),
        ("post", f"/api/deployments/{deployment.pk}/keys/"),
    ]
    for method, url in requests:
        response = getattr(bob_api, method)(url, {}, format="json")
        assert response.status_code == 404, f"{method.upper()} {url} answered {response.status_code}"
    # Nothing changed, and alice still sees all of it.
    assert Run.objects.get(pk=run.pk).status == "queued"
    assert Deployment.objects.get(pk=deployment.pk).status == "pending"
    assert ApiKey.objects.filter(deployment=deployment).count() == 1
    for url in (f"/api/runs/{run.pk}/", f"/api/datasets/{dataset.pk}/", f"/api/deployments/{deployment.pk}/"):
        assert alice_api.get(url).status_code == 200


def test_lists_hold_only_the_callers_objects(bob_api, alices_things):
    for url in ("/api/runs/", "/api/datasets/", "/api/checkpoints/", "/api/deployments/"):
        assert bob_api.get(url).json()["results"] == [], url


def test_bob_cannot_train_on_alices_dataset_or_deploy_her_checkpoint(bob_api, alices_things):
    run = bob_api.post("/api/runs/", {"name": "x", "dataset": alices_things["dataset"].pk}, format="json")
    assert run.status_code == 400
    assert "does not exist" in run.json()["dataset"][0]
    deployment = bob_api.post("/api/deployments/", {"checkpoint": alices_things["checkpoint"].pk}, format="json")
    assert deployment.status_code == 400
    assert "does not exist" in deployment.json()["checkpoint"][0]
