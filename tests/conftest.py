"""Fixtures every part's tests share: a real S3 server (moto's) on a loopback port."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tools.s3_server import S3Server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One moto server for the session, started as a subprocess, stopped at the end; bucket `fathom`."""
    server = S3Server(log_file=tmp_path_factory.mktemp("moto") / "moto.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server, with this process's (and the processes it starts') AWS variables pointing at it."""
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    return s3_server
