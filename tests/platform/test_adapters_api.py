"""A pretrained model deployed as it is, and LoRA runs' checkpoints attached to it as adapters,
through the API: each wrong request is a 400 (or 404, 409) naming the field, and stores nothing.
(Replicas loading and serving an attached adapter: tests/serving/test_pretrained_export_served.py
and tests/serving/test_supervisor_lifecycle.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from django.test import Client
from safetensors.torch import load_file

from deployments import supervision
from deployments.models import Adapter, Deployment
from runs import exports
from runs.models import Checkpoint, PretrainedModel, Run
from tests.platform.test_pretrained_api import upload, write_llama_folder
from tests.serving.conftest import lora_checkpoint_on
from training.export import export

pytestmark = pytest.mark.django_db

LORA = {"max_loras": 2, "max_lora_rank": 8}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Heads of 32 (128 / 4), which vLLM's CPU attention computes.
    return write_llama_folder(tmp_path_factory.mktemp("llama"), hidden_size=128)


@pytest.fixture
def base(alice_api, llama_folder: Path) -> PretrainedModel:
    uploaded = upload(alice_api, llama_folder, name="small llama")
    assert uploaded.status_code == 201, uploaded.content
    return PretrainedModel.objects.get(pk=uploaded.json()["id"])


def checkpoint_of(owner, tmp_path: Path, name: str, *, rank: int, pretrained: PretrainedModel | None) -> Checkpoint:
    """A succeeded run's checkpoint (a folder that is there): a LoRA run's when `rank` > 0."""
    run = Run.objects.create(
        owner=owner, name=name, status="succeeded", pretrained=pretrained,
        spec={"lora": {"rank": rank, "alpha": 16.0}, "train": {"steps": 4}},
    )  # fmt: skip
    folder = tmp_path / name / "step-4"
    folder.mkdir(parents=True)
    return Checkpoint.objects.create(run=run, step=4, path=str(folder))


def page_of(user, deployment: dict):
    """The deployment's page, as its owner's browser gets it."""
    browser = Client()
    browser.force_login(user)
    return browser.get(f"/deployments/{deployment['id']}")


def deploy_base(api, base: PretrainedModel, options: dict | None = None, name: str = "base") -> dict:
    created = api.post(
        "/api/deployments/", {"pretrained": base.pk, "served_model_name": name, "options": LORA if options is None else options},
        format="json",
    )  # fmt: skip
    assert created.status_code == 201, created.content
    return created.json()


def test_a_pretrained_model_is_deployed_as_it_is_and_a_deployment_serves_one_thing(alice_api, base, alice, tmp_path):
    deployment = deploy_base(alice_api, base)
    assert (deployment["pretrained"], deployment["checkpoint"], deployment["adapters"]) == (base.pk, None, [])
    assert (deployment["options"]["max_loras"], deployment["options"]["max_lora_rank"]) == (2, 8)
    assert deployment["options"]["max_model_len"] == 64  # the folder's own context
    assert Deployment.objects.get(pk=deployment["id"]).events.get().kind == "created"
    page = page_of(alice, deployment)
    assert page.status_code == 200 and "the pretrained model <strong>small llama</strong>" in page.content.decode()

    full = checkpoint_of(alice, tmp_path, "full", rank=0, pretrained=None)
    for body in ({"checkpoint": full.pk, "pretrained": base.pk}, {"options": {}}):
        refused = alice_api.post("/api/deployments/", body, format="json")
        assert refused.status_code == 400
        assert list(refused.json()) == ["checkpoint"]
    quantized = alice_api.post("/api/deployments/", {"pretrained": base.pk, "quantization": "int8"}, format="json")
    assert quantized.status_code == 400 and list(quantized.json()) == ["quantization"]
    lora = checkpoint_of(alice, tmp_path, "tuned", rank=8, pretrained=base)
    alone = alice_api.post("/api/deployments/", {"checkpoint": lora.pk}, format="json")
    assert alone.status_code == 400
    assert "holds LoRA adapters" in alone.json()["checkpoint"][0] and "/adapters/" in alone.json()["checkpoint"][0]
    assert Deployment.objects.count() == 1


def test_a_lora_checkpoint_is_attached_to_a_deployment_of_its_base_and_detached(alice_api, base, alice, tmp_path):
    deployment = deploy_base(alice_api, base)
    lora = checkpoint_of(alice, tmp_path, "tuned", rank=8, pretrained=base)
    attached = alice_api.post(f"/api/deployments/{deployment['id']}/adapters/", {"checkpoint": lora.pk}, format="json")
    assert attached.status_code == 201, attached.content
    assert (attached.json()["name"], attached.json()["checkpoint"]) == ("tuned-step4", lora.pk)
    listed = alice_api.get(f"/api/deployments/{deployment['id']}/adapters/").json()
    assert [a["name"] for a in listed["results"]] == ["tuned-step4"]
    shown = alice_api.get(f"/api/deployments/{deployment['id']}/").json()["adapters"]
    assert [(a["name"], a["checkpoint"]) for a in shown] == [("tuned-step4", lora.pk)]
    named = alice_api.post(
        f"/api/deployments/{deployment['id']}/adapters/", {"checkpoint": lora.pk, "name": "support-bot"}, format="json"
    )
    assert named.status_code == 201, named.content
    page = page_of(alice, deployment).content.decode()
    assert "<code>support-bot</code>" in page and "<code>tuned-step4</code>" in page

    detached = alice_api.delete(f"/api/deployments/{deployment['id']}/adapters/{attached.json()['id']}/")
    assert detached.status_code == 204
    assert list(Adapter.objects.values_list("name", flat=True)) == ["support-bot"]
    events = Deployment.objects.get(pk=deployment["id"]).events.values_list("kind", "data")
    assert [(kind, data["name"]) for kind, data in events if kind.startswith("adapter_")] == [
        ("adapter_attached", "tuned-step4"), ("adapter_attached", "support-bot"), ("adapter_detached", "tuned-step4"),
    ]  # fmt: skip


def test_each_wrong_attach_names_its_field_and_stores_nothing(alice_api, bob_api, base, alice, bob, tmp_path, llama_folder):
    deployment = deploy_base(alice_api, base)
    url = f"/api/deployments/{deployment['id']}/adapters/"
    full = checkpoint_of(alice, tmp_path, "full", rank=0, pretrained=base)
    other = PretrainedModel.objects.create(owner=alice, name="other llama", path=str(llama_folder))
    elsewhere = checkpoint_of(alice, tmp_path, "elsewhere", rank=8, pretrained=other)
    wide = checkpoint_of(alice, tmp_path, "wide", rank=16, pretrained=base)
    tuned = checkpoint_of(alice, tmp_path, "tuned", rank=8, pretrained=base)
    bobs = checkpoint_of(bob, tmp_path, "bobs", rank=8, pretrained=base)

    def refused(body: dict, field: str, says: str, api=alice_api, where: str = url) -> None:
        answer = api.post(where, body, format="json")
        assert answer.status_code == 400, answer.content
        assert list(answer.json()) == [field], answer.json()
        assert says in str(answer.json()[field]), answer.json()

    refused({"checkpoint": full.pk}, "checkpoint", "is a full fine-tune's")
    refused({"checkpoint": elsewhere.pk}, "checkpoint", "adapts the pretrained model 'other llama'")
    refused({"checkpoint": wide.pk}, "checkpoint", "rank 16, more than this deployment's options.max_lora_rank (8)")
    refused({"checkpoint": bobs.pk}, "checkpoint", "does not exist")  # not hers: as if it did not exist
    refused({"checkpoint": tuned.pk, "name": "base"}, "name", "this deployment's own model")
    refused({"checkpoint": tuned.pk, "name": "two words"}, "name", "only letters, digits")
    assert alice_api.post(url, {"checkpoint": tuned.pk}, format="json").status_code == 201
    refused({"checkpoint": tuned.pk}, "name", "already an adapter of this deployment")
    plain = deploy_base(alice_api, base, options={}, name="plain")
    refused({"checkpoint": tuned.pk, "name": "x"}, "options", "{'max_loras': ['is 0 on this deployment, whose replicas then run without LoRA", where=f"/api/deployments/{plain['id']}/adapters/")
    refused({"checkpoint": tuned.pk, "name": "plain"}, "name", "already served by another deployment")
    assert bob_api.post(url, {"checkpoint": bobs.pk}, format="json").status_code == 404  # her deployment

    Deployment.objects.filter(pk=deployment["id"]).update(status="stopped")
    stopped = alice_api.post(url, {"checkpoint": tuned.pk, "name": "late"}, format="json")
    assert stopped.status_code == 409 and list(stopped.json()) == ["status"]
    assert list(Adapter.objects.values_list("name", flat=True)) == ["tuned-step4"]


def test_a_lora_checkpoint_is_deployed_merged_into_its_base_on_request(alice_api, base, alice, tmp_path, settings):
    """With a real LoRA run's checkpoint: `merged: true` deploys it as one model, exported (as
    the start task does) by `training.export --merged` beside its adapter export."""
    settings.RUNS_DIR = tmp_path / "runs"
    trained = lora_checkpoint_on(Path(base.path), tmp_path / "lora")
    run = Run.objects.create(owner=alice, name="tuned", status="succeeded", pretrained=base, spec={"lora": {"rank": 8}})
    lora = Checkpoint.objects.create(run=run, step=6, path=str(trained))
    full = checkpoint_of(alice, tmp_path, "full", rank=0, pretrained=None)
    refused = alice_api.post("/api/deployments/", {"checkpoint": full.pk, "merged": True}, format="json")
    assert refused.status_code == 400 and list(refused.json()) == ["merged"]
    quantized = alice_api.post("/api/deployments/", {"checkpoint": lora.pk, "merged": True, "quantization": "int8"}, format="json")
    assert quantized.status_code == 400 and list(quantized.json()) == ["quantization"]

    created = alice_api.post("/api/deployments/", {"checkpoint": lora.pk, "merged": True}, format="json")
    assert created.status_code == 201, created.content
    assert (created.json()["merged"], created.json()["served_model_name"]) == (True, "tuned-step6")
    deployment = Deployment.objects.get(pk=created.json()["id"])
    served = Path(supervision._export_path(deployment))
    assert served == exports.merged_folder(lora)
    reference = export(trained, tmp_path / "merged")
    ours, theirs = load_file(str(served / "model.safetensors")), load_file(str(reference / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert (served / "tokenizer.json").is_file()
    assert supervision._export_path(deployment) == str(served)  # made once
