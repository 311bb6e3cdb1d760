"""Fixtures every part's tests share: a real S3 server (moto's) on a loopback port, and a real
one-machine Slurm cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3fs

from tests.timings import TimingsRecorder, what_it_starts
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


# What a test costs, by what it starts: the mean seconds a test of each kind took in a serial run
# of the suite (docs/testing.md). Only the order of the work handed to the workers uses them.
SECONDS_BY_STARTS = {
    "namespace hosts": 62, "Slurm": 35, "browser": 12, "vLLM replicas": 47, "web/worker stack": 14, "S3": 6,
    "torchrun ranks": 13, "in-process": 0.7,
}  # fmt: skip
# In these parts an "in-process" test mostly starts ranks all the same (tools.check_parity.launch).
SECONDS_IN_PROCESS_TIERS = 5.0
# The tests that share something of the machine's, which one worker then runs one after another:
# a namespace test's bridge takes the first free 10.77.X network (two at once could pick the
# same), and a Slurm cluster's one node holds all of this machine's cores (a second worker's
# cluster would claim them again, and the tests of a job waiting for cores rely on its own).
MACHINE_WIDE = ("namespace hosts", "Slurm")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--timings")
    if path and not hasattr(config, "workerinput"):  # pytest-xdist's workers send their reports to the controller
        config.pluginmanager.register(TimingsRecorder(Path(path)), "fathom-timings")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    starts: dict[pytest.Item, str] = {}
    timed = bool(config.getoption("--timings"))
    for item in items:
        starts[item], markers = what_it_starts(item)
        if timed:  # for the recorder, which may be in pytest-xdist's controller
            item.user_properties += [("starts", starts[item]), ("markers", markers)]
    if config.getoption("--quick"):
        quick = [starts[item] == "in-process" and not item.nodeid.startswith(PROCESS_TIERS) for item in items]
        config.hook.pytest_deselected(items=[item for item, keep in zip(items, quick, strict=True) if not keep])
        items[:] = [item for item, keep in zip(items, quick, strict=True) if keep]
    if getattr(config.option, "loadgroup", False):
        hand_out_to_workers(items, starts)


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook, here only when it runs
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """Stops a two-worker run whose groups pytest-xdist did not take. It writes each test's group
    into the test's id (every test has one under loadgroup: hand_out_to_workers), which pytest
    9.2's structured ids drop (pytest-dev/pytest-xdist#1386); it then hands the tests out one by
    one, and two Slurm clusters and two namespace bridges start at once."""
    if node.config.getoption("dist") != "loadgroup":
        return
    lost = [nodeid for nodeid in ids if "@" not in nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not take the groups of {len(lost)} tests (the first: {lost[0]}); "
            "pyproject.toml pins the pytest under which it does"
        )


def hand_out_to_workers(items: list[pytest.Item], starts: dict[pytest.Item, str]) -> None:
    """Groups for `pytest -n N --dist loadgroup`, the most expensive first (with
    --no-loadscope-reorder the workers take them in this order, so no long group starts last).

    A file's tests stay on one worker, which starts a module's servers once (a module-scoped
    vLLM replica), unless the file is marked `spread` (its tests share nothing: each goes out on
    its own); the tests that share something machine-wide form one group each."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        shared = starts[item] if starts[item] in MACHINE_WIDE else None
        own = item.nodeid if item.get_closest_marker("spread") else item.nodeid.split("::", 1)[0]
        group = shared or own
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)

    def seconds(item: pytest.Item) -> float:
        if starts[item] == "in-process" and item.nodeid.startswith(PROCESS_TIERS):
            return SECONDS_IN_PROCESS_TIERS
        return SECONDS_BY_STARTS[starts[item]]

    ordered = sorted(groups.values(), key=lambda group: -sum(map(seconds, group)))
    items[:] = [item for group in ordered for item in group]


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
