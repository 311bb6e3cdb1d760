"""A deployment's options are resolved and checked once, when it is created, and stored resolved.

A real checkpoint, written by a real one-rank run, not yet exported: the API checks the options
against the config.json its export will carry, names a bad option and stores nothing, and stores
a good one with its defaults filled in. After the real export, the checkpoint facts the options
were checked against are the export's own.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from deployments.models import Deployment
from deployments.options import export_info
from hosts.models import Host
from runs import exports
from runs.models import Checkpoint, QuantizedExport, Run
from serving.vllm import CheckpointInfo, DeviceInfo
from tools.check_parity import launch, parity_spec
from training.run_dir import RunDir

pytestmark = pytest.mark.django_db

AVX2 = ["avx", "avx2", "fma"]
AVX512 = ["avx", "avx2", "avx512f", "avx512bw", "fma"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run folder of a 2-step tiny run: its one committed checkpoint is the last step."""
    run_dir = tmp_path_factory.mktemp("trained")
    launch(parity_spec(2), run_dir, timeout=600)
    return run_dir


@pytest.fixture
def checkpoint(alice, trained: Path, settings, tmp_path: Path) -> Checkpoint:
    settings.RUNS_DIR = tmp_path / "runs"
    run = Run.objects.create(owner=alice, name="source", spec=parity_spec(2).to_dict(), status="succeeded")
    found = RunDir(trained).latest_checkpoint()
    assert found is not None
    return Checkpoint.objects.create(run=run, step=2, path=str(found))


def test_an_option_the_checkpoint_cannot_serve_is_refused_at_create_and_nothing_is_stored(alice_api, checkpoint):
    seq_len = checkpoint.run.spec["model"]["seq_len"]
    refused = alice_api.post(
        "/api/deployments/", {"checkpoint": checkpoint.pk, "options": {"max_model_len": seq_len + 1}}, format="json"
    )
    assert refused.status_code == 400
    assert refused.json() == {
        "options": {"max_model_len": [f"{seq_len + 1} exceeds the checkpoint's max_position_embeddings ({seq_len})"]}
    }
    unknown = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "options": {"gpus": 2}}, format="json")
    assert unknown.status_code == 400
    assert list(unknown.json()["options"]) == ["gpus"]
    assert Deployment.objects.count() == 0


def test_the_options_are_stored_resolved_at_create(alice_api, checkpoint):
    created = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "options": {}}, format="json")
    assert created.status_code == 201, created.content
    stored = Deployment.objects.get(pk=created.json()["id"]).options
    assert stored["max_model_len"] == checkpoint.run.spec["model"]["seq_len"]  # the model's context
    assert created.json()["options"] == stored


def test_what_the_options_were_checked_against_is_what_the_export_says(checkpoint):
    planned = export_info(checkpoint)
    exported = CheckpointInfo.read(exports.export(checkpoint))
    assert dataclasses.replace(planned, path=exported.path) == exported


def test_a_quantization_fathom_does_not_make_is_refused_naming_the_field_and_the_choices(alice_api, checkpoint):
    for wrong in ("int9", "fp8", "INT8", 8):
        refused = alice_api.post(
            "/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": wrong}, format="json"
        )
        assert refused.status_code == 400
        assert refused.json() == {"quantization": [f"must be one of none, int8, int4; got {wrong!r}"]}
    assert Deployment.objects.count() == 0 and QuantizedExport.objects.count() == 0


def test_a_quantized_deploy_whose_options_contradict_it_is_refused_before_anything_is_quantized(
    alice_api, checkpoint, monkeypatch
):
    # An AVX-512 host's facts, whatever this machine has: on an AVX2 one int4 is refused for its
    # kernel before its dtype is looked at (the test below).
    monkeypatch.setattr("deployments.options.device", lambda: DeviceInfo(kind="cpu", cpu_flags=frozenset(AVX512)))
    clash = alice_api.post(
        "/api/deployments/",
        {"checkpoint": checkpoint.pk, "quantization": "int8", "options": {"quantization": "int4"}},
        format="json",
    )
    assert clash.status_code == 400
    assert clash.json() == {"quantization": [
        "'int8' serves Fathom's int8 export, so options.quantization must be left out; got options.quantization 'int4'"
    ]}  # fmt: skip
    # int4 runs in bfloat16 on vLLM's CPU backend: a float32 int4 deploy is refused at create.
    float32_int4 = alice_api.post(
        "/api/deployments/",
        {"checkpoint": checkpoint.pk, "quantization": "int4", "options": {"dtype": "float32"}},
        format="json",
    )
    assert float32_int4.status_code == 400
    assert list(float32_int4.json()["options"]) == ["dtype"]
    assert "bfloat16" in float32_int4.json()["options"]["dtype"][0]
    assert Deployment.objects.count() == 0 and QuantizedExport.objects.count() == 0


def test_an_int4_deploy_on_an_avx2_cpu_is_refused_before_anything_is_quantized(alice_api, checkpoint, monkeypatch):
    # The facts of an AVX2 host (its vLLM build lacks the 4-bit kernel), whatever this one has;
    # tests/serving/test_quantized_export.py meets the real refusal on such a host.
    avx2 = DeviceInfo(kind="cpu", cpu_flags=frozenset({"avx", "avx2", "fma"}))
    monkeypatch.setattr("deployments.options.device", lambda: avx2)
    refused = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": "int4"}, format="json")
    assert refused.status_code == 400
    assert "'int4' on cpu needs AVX-512" in refused.json()["options"]["quantization"][0]
    assert Deployment.objects.count() == 0 and QuantizedExport.objects.count() == 0


def test_once_hosts_have_joined_an_int4_deploy_is_checked_against_their_cpus_not_this_machines(
    alice_api, checkpoint, monkeypatch
):
    # This machine's CPU could serve int4; the only ready host's cannot, and it decides.
    monkeypatch.setattr("deployments.options.device", lambda: DeviceInfo(kind="cpu", cpu_flags=frozenset(AVX512)))
    Host.objects.create(name="old", address="10.9.0.41", devices=[{"index": 0, "kind": "cpu"}], cpu_flags=AVX2)
    Host.objects.create(name="gone", address="10.9.0.42", devices=[{"index": 0, "kind": "cpu"}], cpu_flags=AVX512,
                        status=Host.Status.LOST)  # fmt: skip
    refused = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": "int4"}, format="json")
    assert refused.status_code == 400
    assert refused.json()["options"]["quantization"] == [
        "no ready host can run it: host old: 'int4' on cpu needs AVX-512: vLLM's CPU build has its 4-bit kernel "
        "only for AVX-512 CPUs, and this one has AVX2 at most; serve 'int8_w8a8' or the float model"
    ]
    assert Deployment.objects.count() == 0 and QuantizedExport.objects.count() == 0
    # The float model needs no such kernel: the same host takes it.
    float_model = alice_api.post(
        "/api/deployments/", {"checkpoint": checkpoint.pk, "served_model_name": "float"}, format="json"
    )
    assert float_model.status_code == 201, float_model.content
    # Once a ready host can run int4, the deploy is taken (placement then gives it only such hosts).
    Host.objects.filter(name="gone").update(status=Host.Status.READY)
    created = alice_api.post(
        "/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": "int4", "served_model_name": "int4"}, format="json"
    )
    assert created.status_code == 201, created.content
    assert created.json()["quantization"] == "int4"


AMX = [*AVX512, "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"]


def test_an_int8_deploy_in_float32_is_refused_where_every_ready_host_has_amx_and_taken_where_one_has_not(
    alice_api, checkpoint, monkeypatch
):
    # vLLM's AMX int8 kernel takes bfloat16/float16 activations only; oneDNN's, without AMX,
    # serves float32. This machine's CPU is left out: the hosts decide.
    monkeypatch.setattr("deployments.options.device", lambda: DeviceInfo(kind="cpu", cpu_flags=frozenset(AVX2)))
    Host.objects.create(name="new", address="10.9.0.51", devices=[{"index": 0, "kind": "cpu"}], cpu_flags=AMX)
    float32_int8 = {"checkpoint": checkpoint.pk, "quantization": "int8", "options": {"dtype": "float32"}}
    refused = alice_api.post("/api/deployments/", float32_int8, format="json")
    assert refused.status_code == 400
    assert list(refused.json()) == ["options"] and list(refused.json()["options"]) == ["dtype"]
    assert refused.json()["options"]["dtype"] == [
        "no ready host can run it: host new: 'int8_w8a8' on a cpu with AMX runs vLLM's AMX int8 kernel, which "
        "takes bfloat16 or float16 activations only (in float32 the replica's engine fails on its first request); "
        "set dtype to 'auto' or 'bfloat16'"
    ]
    assert Deployment.objects.count() == 0 and QuantizedExport.objects.count() == 0
    # The same int8 deploy with dtype left to Fathom is taken: each host's replicas get the dtype
    # its CPU's kernel takes (serving.vllm.replica_dtype, unit-tested in test_replica_options).
    auto = alice_api.post(
        "/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": "int8", "served_model_name": "auto"}, format="json"
    )
    assert auto.status_code == 201, auto.content
    assert auto.json()["options"]["dtype"] == "auto"
    # Once a host without AMX is ready too, float32 is taken (placement gives it only that host).
    Host.objects.create(name="older", address="10.9.0.52", devices=[{"index": 0, "kind": "cpu"}], cpu_flags=AVX512)
    taken = alice_api.post("/api/deployments/", {**float32_int8, "served_model_name": "f32"}, format="json")
    assert taken.status_code == 201, taken.content
    assert taken.json()["options"]["dtype"] == "float32"


def test_an_int8_deploy_of_a_fresh_export_queues_its_quantization_and_waits_for_it(alice_api, checkpoint):
    created = alice_api.post("/api/deployments/", {"checkpoint": checkpoint.pk, "quantization": "int8"}, format="json")
    assert created.status_code == 201, created.content
    assert created.json()["quantization"] == "int8" and created.json()["status"] == "pending"
    row = QuantizedExport.objects.get()
    assert (row.checkpoint_id, row.scheme, row.status) == (checkpoint.pk, "int8", "pending")
    deployment = Deployment.objects.get(pk=created.json()["id"])
    assert deployment.quantized_export == row and deployment.options["quantization"] == "int8_w8a8"
    assert [e.kind for e in deployment.events.order_by("seq")] == ["created", "waiting_for_quantization"]
