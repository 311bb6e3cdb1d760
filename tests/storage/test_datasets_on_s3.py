"""Datasets on object storage and a host's cached copy of them, against a real S3 server (moto's):
content-addressed objects, downloaded once per host, checked, and never seen half-written."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import s3fs

from hostworker.started_environment import StartedEnvironment
from tests.faults.harness import training_spec
from tools.s3_server import S3Server
from training.config import DataConfig, RunSpec
from training.data import prepare_data
from training.rank_environment import RankEnvironment
from training.storage import StorageError, dataset_url, fetch_dataset

CORPUS = b"".join(f"document {i}: the quick brown fox jumps over the lazy dog\n".encode() for i in range(60_000))


@pytest.fixture(autouse=True)
def fresh_clients() -> None:
    # s3fs keeps one client per set of arguments; a test that changes the AWS variables needs a new one.
    s3fs.S3FileSystem.clear_instance_cache()


def stored(s3: S3Server, data: bytes = CORPUS, name: str = "corpus.txt") -> str:
    url = dataset_url(s3.url("datasets-test"), hashlib.sha256(data).hexdigest(), name)
    s3fs.S3FileSystem().pipe_file(url.removeprefix("s3://"), data)
    return url


def test_a_dataset_is_downloaded_once_into_the_host_cache_and_checked(tmp_path: Path, s3: S3Server) -> None:
    url = stored(s3)
    copy = fetch_dataset(url, tmp_path / "cache")
    assert copy == tmp_path / "cache" / "datasets" / hashlib.sha256(CORPUS).hexdigest() / "corpus.txt"
    assert copy.read_bytes() == CORPUS
    s3fs.S3FileSystem().rm_file(url.removeprefix("s3://"))  # a second rank finds the copy: no download
    assert fetch_dataset(url, tmp_path / "cache") == copy


def test_ranks_of_one_host_fetching_at_once_read_one_whole_copy(tmp_path: Path, s3: S3Server) -> None:
    url = stored(s3)
    code = "import sys; from pathlib import Path; from training.storage import fetch_dataset; print(fetch_dataset(sys.argv[1], Path(sys.argv[2])))"
    procs = [
        subprocess.Popen([sys.executable, "-c", code, url, str(tmp_path / "cache")], stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert [p.returncode for p in procs] == [0] * 4
    (copy,) = outputs
    assert Path(copy).read_bytes() == CORPUS
    assert sorted(p.name for p in Path(copy).parent.iterdir()) == [".lock", "corpus.txt"]  # no temporary file left


def test_a_corrupt_dataset_object_is_refused_with_its_name(tmp_path: Path, s3: S3Server) -> None:
    url = stored(s3)
    s3fs.S3FileSystem().pipe_file(url.removeprefix("s3://"), b"something else\n")
    with pytest.raises(StorageError, match=f"dataset object {url} is corrupt: .* its name says {hashlib.sha256(CORPUS).hexdigest()}"):
        fetch_dataset(url, tmp_path / "cache")
    assert sorted(p.name for p in (tmp_path / "cache" / "datasets" / hashlib.sha256(CORPUS).hexdigest()).iterdir()) == [".lock"]


def test_a_missing_dataset_object_or_wrong_credentials_are_named(
    tmp_path: Path, s3: S3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = dataset_url(s3.url("datasets-test"), "0" * 64, "gone.txt")
    with pytest.raises(StorageError, match=f"dataset object {missing} could not be downloaded: the bucket or prefix does not exist"):
        fetch_dataset(missing, tmp_path / "cache")
    url = stored(s3)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(StorageError, match=f"dataset object {url} could not be downloaded: access denied"):
        fetch_dataset(url, tmp_path / "cache")


def test_ranks_cache_datasets_in_their_hosts_data_folder(tmp_path: Path, s3: S3Server) -> None:
    """An agent hears its machine's data folder from the host worker (FATHOM_DATA_DIR) and names
    its cache to each rank, which downloads the dataset there; without one, the run's data
    folder keeps it."""
    run_data = tmp_path / "run" / "data"
    on_host = StartedEnvironment.from_environ({"FATHOM_DATA_DIR": str(tmp_path / "host")})
    assert on_host.cache_root(run_data / "cache") == tmp_path / "host" / "cache"
    assert StartedEnvironment.from_environ({}).cache_root(run_data / "cache") == run_data / "cache"
    told = RankEnvironment(
        run_dir=tmp_path / "run", node_rank=0, attempt=0, heartbeat_file=tmp_path / "beat", heartbeat_interval=0.25,
        events_file=tmp_path / "events.jsonl", download_cache=on_host.cache_root(run_data / "cache"),
    )  # fmt: skip
    heard = RankEnvironment.from_environ(told.to_environ())
    assert heard is not None and heard.download_cache == tmp_path / "host" / "cache"
    prepare_data(DataConfig(dataset=stored(s3)), vocab_size=300, seq_len=16, work_dir=run_data, download_cache=heard.download_cache)
    digest = hashlib.sha256(CORPUS).hexdigest()
    assert (tmp_path / "host" / "cache" / "datasets" / digest / "corpus.txt").read_bytes() == CORPUS
    assert not (run_data / "cache").exists()


@pytest.mark.slow
def test_a_run_whose_dataset_object_is_missing_fails_at_once_naming_it(agents, tmp_path: Path, s3: S3Server) -> None:
    missing = dataset_url(s3.url("datasets-test"), "0" * 64, "gone.txt")
    data = training_spec(steps=2, checkpoint_interval=2, dp=1).to_dict()
    data["data"]["dataset"] = missing
    run = agents.run(RunSpec.from_dict(data), tmp_path / "run")
    assert run.process.returncode != 0
    (failed,) = run.of_kind("failed")
    assert f"dataset object {missing} could not be downloaded: the bucket or prefix does not exist" in json.dumps(failed)
    assert run.of_kind("restarting") == []  # not retried: every attempt would meet it again
