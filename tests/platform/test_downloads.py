"""Downloading a run's logs and a checkpoint's export: streamed tars, for the owner only."""

from __future__ import annotations

import io
import tarfile

import pytest
from django.http import StreamingHttpResponse

from runs.downloads import tar_stream
from runs.models import Checkpoint, Run


def untar(response) -> dict[str, bytes]:
    assert isinstance(response, StreamingHttpResponse)  # never an archive built in memory
    assert response["Content-Type"] == "application/x-tar"
    with tarfile.open(fileobj=io.BytesIO(b"".join(response.streaming_content)), mode="r:") as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.fixture
def exported(alice):
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.SUCCEEDED)
    export = run.folder / "exports" / "step_20"
    export.mkdir(parents=True)
    (export / "config.json").write_text('{"model_type": "llama"}')
    (export / "model.safetensors").write_bytes(bytes(range(256)) * 5000)  # not a multiple of 512
    (export / "tokenizer").mkdir()
    (export / "tokenizer" / "tokenizer.json").write_text("{}")
    return Checkpoint.objects.create(run=run, step=20, path=str(run.folder / "ckpt"), export_path=str(export))


@pytest.mark.django_db
def test_the_owner_downloads_a_checkpoints_export(alice_api, exported):
    response = alice_api.get(f"/api/runs/{exported.run_id}/checkpoints/{exported.pk}/export.tar")
    assert response.status_code == 200
    root = f"run-{exported.run_id}-step-20-export"
    assert f'filename="{root}.tar"' in response["Content-Disposition"]
    files = untar(response)
    assert sorted(files) == [f"{root}/config.json", f"{root}/model.safetensors", f"{root}/tokenizer/tokenizer.json"]
    assert files[f"{root}/model.safetensors"] == bytes(range(256)) * 5000


@pytest.mark.django_db
def test_another_users_export_and_logs_answer_404(bob_api, exported):
    assert bob_api.get(f"/api/runs/{exported.run_id}/checkpoints/{exported.pk}/export.tar").status_code == 404
    exported.run.run_dir.logs_dir.mkdir(parents=True)
    assert bob_api.get(f"/api/runs/{exported.run_id}/logs.tar").status_code == 404


@pytest.mark.django_db
def test_a_checkpoint_of_another_run_is_not_found_under_this_one(alice, alice_api, exported):
    other = Run.objects.create(owner=alice, name="other", spec={})
    assert alice_api.get(f"/api/runs/{other.pk}/checkpoints/{exported.pk}/export.tar").status_code == 404
    # An id past SQLite's 64-bit integers is no run either (it was a 500).
    huge = 158728417109384658944
    assert alice_api.get(f"/api/runs/{huge}/checkpoints/{exported.pk}/export.tar").status_code == 404
    assert alice_api.get(f"/api/runs/{exported.run_id}/checkpoints/{huge}/export.tar").status_code == 404


@pytest.mark.django_db
def test_a_checkpoint_without_an_export_says_so(alice, alice_api):
    run = Run.objects.create(owner=alice, name="r", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=10, path=str(run.folder / "ckpt"))
    response = alice_api.get(f"/api/runs/{run.pk}/checkpoints/{checkpoint.pk}/export.tar")
    assert response.status_code == 409
    assert response.json() == {"export_path": ["step 10 has not been exported to Hugging Face format"]}
    Checkpoint.objects.filter(pk=checkpoint.pk).update(export_path="s3://bucket/runs/1/exports/step_10")
    remote = alice_api.get(f"/api/runs/{run.pk}/checkpoints/{checkpoint.pk}/export.tar")
    assert remote.status_code == 409
    assert "on object storage, at s3://bucket/runs/1/exports/step_10" in remote.json()["export_path"][0]


@pytest.mark.django_db
def test_the_owner_downloads_a_runs_logs(alice, alice_api, client):
    run = Run.objects.create(owner=alice, name="r", spec={})
    assert alice_api.get(f"/api/runs/{run.pk}/logs.tar").json() == {"detail": "this run has written no logs yet"}
    logs = run.run_dir.logs_dir
    logs.mkdir(parents=True)
    run.run_dir.rank_log(0).write_text("step 1 loss 9.1\n")
    run.run_dir.rank_log(1).write_text("step 1 loss 9.2\n")
    (logs / "agent-node0.log").write_text("agent up\n")
    files = untar(alice_api.get(f"/api/runs/{run.pk}/logs.tar"))
    root = f"run-{run.pk}-logs"
    assert files == {
        f"{root}/agent-node0.log": b"agent up\n",
        f"{root}/rank0.log": b"step 1 loss 9.1\n",
        f"{root}/rank1.log": b"step 1 loss 9.2\n",
    }
    client.force_login(alice)
    assert f'href="/api/runs/{run.pk}/logs.tar"' in client.get(f"/runs/{run.pk}").content.decode()


def test_a_file_that_grows_while_it_is_sent_keeps_the_archive_valid(tmp_path):
    (tmp_path / "rank0.log").write_text("a" * 1000)
    chunks = tar_stream(tmp_path, "logs")
    header = next(chunks)
    with (tmp_path / "rank0.log").open("a") as f:  # the live run writes on
        f.write("b" * 5000)
    archive = header + b"".join(chunks)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as tar:
        assert tar.extractfile("logs/rank0.log").read() == b"a" * 1000
