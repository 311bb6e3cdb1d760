"""Pretrained models through the API: a user uploads a Hugging Face Llama folder (or an
administrator registers one on the server), owned like a dataset, and a run names it by id; the
stored spec then holds the folder's model and tokenizer, and the run's layout is checked against
that model. (The ranks that start from it are tests/training/test_pretrained.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from runs.models import PretrainedModel, Run
from tests.training.test_pretrained import save_small_llama
from training.data import save_tokenizer, train_tokenizer

pytestmark = pytest.mark.django_db


def write_llama_folder(folder: Path, hidden_size: int = 64) -> Path:
    """A small random Llama as `transformers` saves it, with a byte-level tokenizer beside it."""
    save_small_llama(folder, hidden_size=hidden_size)
    documents = (f"document {i} about counting {i} sheep" for i in range(200))
    save_tokenizer(train_tokenizer(documents, 512), folder, 64)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_folder(tmp_path_factory.mktemp("llama"))


def upload(api, folder: Path, names: list[str] | None = None, name: str = "small llama"):
    files = [
        SimpleUploadedFile(file.name, file.read_bytes())
        for file in sorted(folder.iterdir())
        if names is None or file.name in names
    ]
    return api.post("/api/pretrained-models/", {"name": name, "files": files}, format="multipart")


def test_an_uploaded_folder_is_its_owners_and_a_run_from_it_takes_its_model_and_tokenizer(alice_api, bob_api, llama_folder):
    uploaded = upload(alice_api, llama_folder)
    assert uploaded.status_code == 201, uploaded.content
    model = uploaded.json()
    assert (model["model"]["n_layers"], model["model"]["dim"], model["model"]["n_kv_heads"]) == (2, 64, 2)
    stored = Path(PretrainedModel.objects.get(pk=model["id"]).path)
    assert sorted(p.name for p in stored.iterdir()) == sorted(p.name for p in llama_folder.iterdir())
    assert bob_api.get(f"/api/pretrained-models/{model['id']}/").status_code == 404
    assert [m["id"] for m in bob_api.get("/api/pretrained-models/").json()["results"]] == []

    body = {"name": "continued", "pretrained": model["id"], "spec": {"model": {"seq_len": 32}, "train": {"steps": 10}}}
    created = alice_api.post("/api/runs/", body, format="json")
    assert created.status_code == 201, created.content
    spec = Run.objects.get(pk=created.json()["id"]).spec
    assert (spec["model"]["dim"], spec["model"]["n_layers"], spec["model"]["seq_len"]) == (64, 2, 32)
    assert spec["data"]["pretrained"] == str(stored)
    assert spec["data"]["tokenizer"] == str(stored / "tokenizer.json")
    assert created.json()["pretrained"] == model["id"]

    # Another user cannot start from it: the id reads as unknown.
    refused = bob_api.post("/api/runs/", {"pretrained": model["id"]}, format="json")
    assert refused.status_code == 400 and "pretrained" in refused.json()

    # A clone starts from the same model, its model section from the folder again.
    clone = alice_api.post(f"/api/runs/{created.json()['id']}/clone/", {"spec": {"train": {"steps": 12}}}, format="json")
    assert clone.status_code == 201, clone.content
    assert clone.json()["pretrained"] == model["id"]
    assert Run.objects.get(pk=clone.json()["id"]).spec["model"] == spec["model"]


def test_a_run_from_a_pretrained_model_is_checked_against_its_model_not_the_recipes(alice, alice_api, llama_folder):
    model_id = upload(alice_api, llama_folder).json()["id"]
    given_sizes = alice_api.post("/api/runs/", {"pretrained": model_id, "spec": {"model": {"dim": 256}}}, format="json")
    assert given_sizes.status_code == 400
    assert "takes its model from it" in given_sizes.json()["spec"]["model"]["dim"][0]
    # The folder has 2 KV heads: tp=4 cannot split them, whatever the recipe's model would allow.
    too_wide = alice_api.post("/api/runs/", {"pretrained": model_id, "spec": {"layout": {"tp": 4}}}, format="json")
    assert too_wide.status_code == 400
    assert "n_kv_heads=2" in too_wide.json()["spec"]["layout"]["tp"][0]
    earlier = Run.objects.create(owner=alice, name="earlier", spec={})
    both = alice_api.post("/api/runs/", {"pretrained": model_id, "tokenizer_run": earlier.pk}, format="json")
    assert both.status_code == 400 and "uses its tokenizer" in both.json()["tokenizer_run"][0]


def test_a_path_in_the_spec_is_refused_and_the_field_to_use_is_named(alice_api, llama_folder):
    response = alice_api.post("/api/runs/", {"spec": {"data": {"pretrained": str(llama_folder)}}}, format="json")
    assert response.status_code == 400
    assert '"pretrained" field' in response.json()["spec"]["data"]["pretrained"][0]


@pytest.mark.parametrize(
    ("names", "error"),
    [
        (["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"], "holds neither model.safetensors"),
        (["config.json", "model.safetensors", "tokenizer_config.json"], "has no tokenizer.json"),
    ],
    ids=["no-weights", "no-tokenizer"],
)
def test_an_incomplete_folder_is_refused_naming_what_it_lacks_and_nothing_is_kept(alice_api, llama_folder, names, error):
    response = upload(alice_api, llama_folder, names)
    assert response.status_code == 400
    assert error in response.json()["files"][0]
    assert not PretrainedModel.objects.exists()


def test_a_file_that_is_not_part_of_a_llama_folder_is_refused(alice_api, llama_folder):
    response = alice_api.post(
        "/api/pretrained-models/", {"files": [SimpleUploadedFile("../../etc/cron.d/x", b"* * * * * root true\n")]},
        format="multipart",
    )  # fmt: skip
    assert response.status_code == 400
    assert "is not a file of a Hugging Face Llama folder" in response.json()["files"][0]


def test_only_an_administrator_registers_a_server_folder(alice, alice_api, llama_folder):
    refused = alice_api.post("/api/pretrained-models/", {"path": str(llama_folder)}, format="json")
    assert refused.status_code == 400 and "only administrators" in refused.json()["path"][0]
    alice.is_staff = True
    alice.save()
    registered = alice_api.post("/api/pretrained-models/", {"path": str(llama_folder)}, format="json")
    assert registered.status_code == 201, registered.content
    assert PretrainedModel.objects.get(pk=registered.json()["id"]).path == str(llama_folder.resolve())
