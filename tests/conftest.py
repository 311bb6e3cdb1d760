"""Fixtures every part's tests share: a real S3 server (moto's) on a loopback port, and a real
one-machine Slurm cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import s3fs

from tests.timings import TimingsRecorder, starts_of
from tools.s3_server import S3Server
from tools.slurm_cluster import SlurmCluster


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--timings", metavar="FILE", default=None,
        help="write each test's wall time and what it starts to FILE (python -m tools.test_timings FILE groups them)",
    )  # fmt: skip


    parser.addoption(
        "--quick", action="store_true", default=False,
        help="the inner loop's tier (make test-quick): the control plane's, serving's and the planner's "
        "tests that start no process (docs/testing.md)",
    )  # fmt: skip


# The parts whose tests mostly start ranks, agents or browsers, and so stay out of the quick tier.
PROCESS_TIERS = ("tests/training/", "tests/faults/", "tests/storage/", "tests/e2e/")


def pytest_configure(config: pytest.Config) -> None:
    if path := config.getoption("--timings"):
        config.pluginmanager.register(TimingsRecorder(Path(path)), "fathom-timings")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--quick"):
        return
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        in_process = starts_of(set(getattr(item, "fixturenames", ())), markers) == "in-process"
        (keep if in_process and not item.nodeid.startswith(PROCESS_TIERS) else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the session, started as a subprocess, stopped at the end; bucket `fathom`."""
    server = S3Server(log_file=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    yield server
    server.stop()


def forget_s3_clients() -> None:
    """Drops the S3 filesystems fsspec keeps per process: each took its endpoint and keys from the
    environment when it was made, and another test's S3 server (the namespace tests' on their
    bridge) may be gone by now."""
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    """The S3 server, with this process's (and the processes it starts') AWS variables pointing at it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    forget_s3_clients()
    yield s3_server
    forget_s3_clients()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munge, slurmctld and one slurmd (installed with apt-get if missing), with their state in
    a folder of the session; the Slurm daemons are stopped at the end."""
    cluster = SlurmCluster(state=tmp_path_factory.mktemp("slurm"))
    cluster.start()
    yield cluster
    cluster.stop()


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The cluster, with runs going to it: FATHOM_EXECUTOR=slurm and SLURM_CONF for the
    processes the test starts after this fixture (the web process, the Celery worker)."""
    for name, value in slurm_cluster.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("FATHOM_EXECUTOR", "slurm")
    monkeypatch.setenv("FATHOM_SLURM_POLL_INTERVAL", "1")
    return slurm_cluster
