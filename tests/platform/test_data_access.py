"""A run reads only data its owner may use: their own datasets and their own runs' tokenizers.

Raw server paths are refused wherever a user could send one (the run body, a clone's edits, a
dataset registration), so no user can train on, and so recover from a model, a file of the
server or another user's upload. Administrators alone may register server files as datasets.
"""

from __future__ import annotations

import json
import os

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from tokenizers import Tokenizer

from launch import run_agents
from runs.models import Dataset, Run
from tests.platform.conftest import client_for
from training.data import save_tokenizer, train_tokenizer
from training.run_dir import RunDir

pytestmark = pytest.mark.django_db

PATH_FIELDS = ["dataset", "tokenizer", "pretrained"]
# What each refusal points the user to instead of a path.
INSTEAD = {"dataset": '"dataset"', "tokenizer": "tokenizer_run", "pretrained": '"pretrained" field'}


@pytest.fixture
def alices_upload(alice) -> Dataset:
    response = client_for(alice).post(
        "/api/datasets/", {"file": SimpleUploadedFile("diary.txt", b"alice's secret diary\n")}, format="multipart"
    )
    assert response.status_code == 201, response.content
    return Dataset.objects.get(pk=response.json()["id"])


def give_tokenizer(run: Run, vocab_size: int = 300) -> Tokenizer:
    """What a run's ranks leave in its folder once they prepared the data (training/data.py)."""
    tokenizer = train_tokenizer(iter(["the quick brown fox jumps over the lazy dog"] * 20), vocab_size)
    save_tokenizer(tokenizer, run.tokenizer_dir, model_max_length=64)
    return tokenizer


@pytest.mark.parametrize("field", PATH_FIELDS)
def test_a_server_path_in_a_spec_is_refused_naming_the_field(bob_api, alices_upload, field):
    for path in ("/etc/services", alices_upload.path, "../../etc/passwd"):
        response = bob_api.post("/api/runs/", {"name": "x", "spec": {"data": {field: path}}}, format="json")
        assert response.status_code == 400, response.content
        message = response.json()["spec"]["data"][field][0]
        assert "server paths are not accepted" in message
        assert INSTEAD[field] in message
    assert Run.objects.count() == 0


@pytest.mark.parametrize("field", PATH_FIELDS)
def test_a_clone_cannot_bring_a_server_path_in_through_its_edits(bob_api, field):
    source = bob_api.post("/api/runs/", {"name": "mine"}, format="json").json()
    response = bob_api.post(
        f"/api/runs/{source['id']}/clone/", {"spec": {"data": {field: "/etc/services"}}}, format="json"
    )
    assert response.status_code == 400, response.content
    assert "server paths are not accepted" in response.json()["spec"]["data"][field][0]
    assert Run.objects.count() == 1


def test_a_spec_whose_data_section_is_not_an_object_is_refused(bob_api):
    response = bob_api.post("/api/runs/", {"name": "x", "spec": {"data": "/etc/services"}}, format="json")
    assert response.status_code == 400
    assert "must be an object" in response.json()["spec"]["data"][0]


def test_only_an_administrator_registers_a_server_file_as_a_dataset(bob_api, admin_user, alices_upload, tmp_path):
    for path in ("/etc/services", alices_upload.path):
        response = bob_api.post("/api/datasets/", {"path": path}, format="json")
        assert response.status_code == 400
        assert "only administrators" in response.json()["path"][0]
    assert not Dataset.objects.filter(owner__username="bob").exists()

    corpus = tmp_path / "shared-corpus.txt"
    corpus.write_text("a line the operator put on the server\n")
    response = client_for(admin_user).post("/api/datasets/", {"path": str(corpus)}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["records"] == 1


def test_another_users_dataset_or_run_reads_as_unknown(alice, bob_api, alices_upload):
    alices_run = Run.objects.create(owner=alice, name="alice's", spec={})
    give_tokenizer(alices_run)
    response = bob_api.post(
        "/api/runs/", {"name": "x", "dataset": alices_upload.pk, "tokenizer_run": alices_run.pk}, format="json"
    )
    assert response.status_code == 400
    assert "does not exist" in response.json()["dataset"][0]
    assert "does not exist" in response.json()["tokenizer_run"][0]


def test_a_dataset_whose_file_is_gone_is_refused_at_submit(alice_api, alices_upload):
    with open(alices_upload.path, "w"):
        pass  # emptied, as a disk mishap would leave it
    response = alice_api.post("/api/runs/", {"name": "x", "dataset": alices_upload.pk}, format="json")
    assert response.status_code == 400
    assert "empty or unreadable" in response.json()["dataset"][0]
    os.remove(alices_upload.path)
    response = alice_api.post("/api/runs/", {"name": "x", "dataset": alices_upload.pk}, format="json")
    assert "is gone" in response.json()["dataset"][0]
    assert not Run.objects.exists()


def test_a_tokenizer_run_must_have_a_tokenizer_that_fits_the_vocabulary(alice, alice_api):
    earlier = Run.objects.create(owner=alice, name="earlier", spec={})
    response = alice_api.post("/api/runs/", {"name": "x", "tokenizer_run": earlier.pk}, format="json")
    assert response.status_code == 400
    assert "has no tokenizer yet" in response.json()["tokenizer_run"][0]

    give_tokenizer(earlier, vocab_size=300)
    small_vocab = {"model": {"vocab_size": 256}}
    response = alice_api.post(
        "/api/runs/", {"name": "x", "tokenizer_run": earlier.pk, "spec": small_vocab}, format="json"
    )
    assert response.status_code == 400
    assert "more than spec.model.vocab_size=256" in response.json()["tokenizer_run"][0]

    response = alice_api.post("/api/runs/", {"name": "x", "tokenizer_run": earlier.pk}, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["tokenizer_run"] == earlier.pk


def test_a_run_stores_the_paths_of_the_objects_it_names_and_the_launcher_writes_them(alice, alice_api, alices_upload):
    earlier = Run.objects.create(owner=alice, name="earlier", spec={})
    give_tokenizer(earlier)
    created = alice_api.post(
        "/api/runs/", {"name": "x", "dataset": alices_upload.pk, "tokenizer_run": earlier.pk}, format="json"
    ).json()
    run = Run.objects.get(pk=created["id"])
    # Resolved at submit, from the objects only: the API refuses a path from the user.
    assert run.spec["data"] == {
        "dataset": alices_upload.path,
        "tokenizer": str(earlier.tokenizer_dir),
        "storage": "",
        "validation_dataset": "",
        "validation_fraction": 0.0,
        "pretrained": "",
    }
    folder = run_agents.prepare(run).folder
    assert json.loads(RunDir(folder).spec_file.read_text()) == run.spec

    plain = alice_api.post("/api/runs/", {"name": "y"}, format="json").json()
    folder = run_agents.prepare(Run.objects.get(pk=plain["id"])).folder
    assert json.loads(RunDir(folder).spec_file.read_text())["data"] == {
        "dataset": "", "tokenizer": "", "storage": "", "validation_dataset": "", "validation_fraction": 0.0,
        "pretrained": "",
    }


def test_a_clone_keeps_the_sources_data_objects(alice, alice_api, alices_upload):
    earlier = Run.objects.create(owner=alice, name="earlier", spec={})
    give_tokenizer(earlier)
    source = alice_api.post(
        "/api/runs/", {"name": "s", "dataset": alices_upload.pk, "tokenizer_run": earlier.pk}, format="json"
    ).json()
    clone = alice_api.post(f"/api/runs/{source['id']}/clone/", {}, format="json")
    assert clone.status_code == 201, clone.content
    assert (clone.json()["dataset"], clone.json()["tokenizer_run"]) == (alices_upload.pk, earlier.pk)
