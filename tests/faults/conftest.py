"""Fixtures for the fault tests; the machinery is in `harness.py`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Agents, IngestServer
from training.config import RunSpec


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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[RunSpec], dict[int, float]]]:
    """The losses by step of `spec`'s run with its faults left out, each spec run once a module:
    a module's tests that inject different faults into one recipe compare with one clean run."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    runner = Agents(tmp_path=tmp, entrypoint="training.train")
    losses: dict[str, dict[int, float]] = {}

    def of(spec: RunSpec) -> dict[int, float]:
        clean = dataclasses.replace(spec, faults=[])
        key = clean.to_json()
        if key not in losses:
            run = runner.run(clean, tmp / f"clean-{len(losses)}")
            assert run.process.returncode == 0, run.tail()
            losses[key] = run.losses()
        return losses[key]

    yield of
    runner.cleanup()
