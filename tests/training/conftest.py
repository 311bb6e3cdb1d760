"""Shared pieces of the training tests: one tiny corpus and tokenizer for every run of a session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from training.check_parity import shared_data
from training.config import DataConfig, tiny

torch.set_num_threads(1)  # the test process shares the host's few cores with the ranks it launches


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> DataConfig:
    """The demo corpus and a tokenizer trained on it, prepared once: runs that share them see the same tokens."""
    return shared_data(tmp_path_factory.mktemp("data"), tiny())


@pytest.fixture(scope="session")
def tokenizer_dir(tiny_data: DataConfig) -> Path:
    return Path(tiny_data.tokenizer).parent
