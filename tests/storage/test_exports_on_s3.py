"""Exports on object storage and a serving host's cache of them, against a real S3 server (moto's).

The export here is a folder of files as `training.export` writes them (the store moves bytes,
whatever they hold); the control plane's export of a real checkpoint on S3 is in
tests/platform/test_run_storage.py.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

from serving import export_store
from serving.deployment_config import DeploymentConfig
from serving.export_store import MANIFEST, ExportStoreError
from serving.supervisor import export_cache_root
from tools.s3_server import S3Server

FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "tokenizer.json": b'{"model": {}}',
    "tokenizer_config.json": b"{}",
    "model.safetensors": os.urandom(3 << 20),
}


@pytest.fixture(autouse=True)
def fresh_clients() -> None:
    # s3fs keeps one client per set of arguments; a test that changes the AWS variables needs a new one.
    s3fs.S3FileSystem.clear_instance_cache()


def uploaded(tmp_path: Path, s3: S3Server, prefix: str) -> str:
    folder = tmp_path / "export"
    folder.mkdir()
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    url = s3.url(prefix)
    export_store.upload(folder, url)
    return url


def test_an_export_is_downloaded_into_the_host_cache_once_and_checked(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/once")
    cache = tmp_path / "cache"
    copy = export_store.fetch(url, cache)
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != MANIFEST} == FILES
    # Keyed by the manifest's checksum: the same export is served from the cache, without a download.
    fs = s3fs.S3FileSystem()
    fs.rm_file(url.removeprefix("s3://") + "/model.safetensors")
    assert export_store.fetch(url, cache) == copy
    assert [p.name for p in (cache / "exports").iterdir()] == [copy.name]


def test_an_export_without_its_manifest_is_never_served(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/torn")
    s3fs.S3FileSystem().rm_file(url.removeprefix("s3://") + "/" + MANIFEST)
    with pytest.raises(ExportStoreError, match=f"export {url} cannot be served: it has no {MANIFEST}"):
        export_store.fetch(url, tmp_path / "cache")


def test_a_corrupt_object_is_refused_with_its_name_and_nothing_is_cached(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/corrupt")
    s3fs.S3FileSystem().pipe_file(url.removeprefix("s3://") + "/model.safetensors", b"not the weights")
    expected = hashlib.sha256(FILES["model.safetensors"]).hexdigest()
    with pytest.raises(ExportStoreError, match=f"export object {url}/model.safetensors is corrupt: .* says {expected}"):
        export_store.fetch(url, tmp_path / "cache")
    assert list((tmp_path / "cache" / "exports").iterdir()) == []


def test_a_missing_object_is_named_with_the_reason(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/missing")
    s3fs.S3FileSystem().rm_file(url.removeprefix("s3://") + "/tokenizer.json")
    with pytest.raises(ExportStoreError, match=f"export object {url}/tokenizer.json could not be downloaded: it does not exist"):
        export_store.fetch(url, tmp_path / "cache")


def test_wrong_credentials_are_named_as_such(tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    url = uploaded(tmp_path, s3, "exports/credentials")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(ExportStoreError, match=f"export object {url}/{MANIFEST} could not be read: access denied"):
        export_store.fetch(url, tmp_path / "cache")


def test_supervisors_of_one_host_downloading_at_once_share_one_whole_copy(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/concurrent")
    cache = tmp_path / "cache"
    code = "import sys; from pathlib import Path; from serving.export_store import fetch; print(fetch(sys.argv[1], Path(sys.argv[2])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, str(cache)], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert len(set(outputs)) == 1
    copy = Path(outputs[0])
    assert {p.name: p.read_bytes() for p in copy.iterdir() if p.name != MANIFEST} == FILES
    assert [p.name for p in (cache / "exports").iterdir()] == [copy.name]  # no temporary folder left


def test_the_web_process_downloads_only_the_tokenizer(tmp_path: Path, s3: S3Server) -> None:
    url = uploaded(tmp_path, s3, "exports/tokenizer")
    copy = Path(export_store.local_copy(url, tmp_path / "cache", tokenizer_only=True))
    assert sorted(p.name for p in copy.iterdir()) == sorted([MANIFEST, "tokenizer.json", "tokenizer_config.json"])
    assert export_store.local_copy(str(tmp_path / "export"), tmp_path / "cache") == str(tmp_path / "export")


def test_a_supervisor_caches_exports_in_its_hosts_data_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = DeploymentConfig(name="m", export="s3://fathom/x", state_dir=str(tmp_path / "deployment"), python="python")
    monkeypatch.setenv("FATHOM_DATA_DIR", str(tmp_path / "host"))
    assert export_cache_root(config) == tmp_path / "host" / "cache"
    monkeypatch.delenv("FATHOM_DATA_DIR")
    assert export_cache_root(config) == tmp_path / "deployment" / "cache"
