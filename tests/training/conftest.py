"""Shared pieces of the training tests: one tiny corpus and tokenizer for every run of a session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tools.check_parity import shared_data
from training.config import DataConfig, tiny

torch.set_num_threads(1)  # the test process shares the host's few cores with the ranks it launches


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    """The demo corpus and a tokenizer trained on it, prepared once: runs that share them see the same tokens."""
    return shared_data(tmp_path_factory.mktemp("data"), tiny())


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_data: DataConfig) -> Path:
    return Path(tiny_data.tokenizer).parent


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group in this test's process: enough to build FSDP and TP modules."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
