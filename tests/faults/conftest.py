"""Fixtures for the fault tests; the machinery is in `harness.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Agents, IngestServer


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    """Agents whose ranks run the real trainer (`python -m training.train`)."""
    runner = Agents(tmp_path=tmp_path, entrypoint="training.train")
    yield runner
    runner.cleanup()


@pytest.fixture
def ingest() -> Iterator[IngestServer]:
    server = IngestServer(token="run-token-123")
    server.start()
    yield server
    server.stop()
