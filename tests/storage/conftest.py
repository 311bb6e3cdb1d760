"""Node agents for the storage tests, as the fault tests start them (`tests/faults/harness.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.faults.harness import Agents


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    runner = Agents(tmp_path=tmp_path, entrypoint="training.train")
    yield runner
    runner.cleanup()
