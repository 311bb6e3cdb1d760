"""FSDP2 in bf16: weights gathered in bf16 for compute, fp32 shards and gradients kept as the master copy."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from training.config import tiny
from training.model import Transformer, cross_entropy_loss
from training.parallel.fsdp import apply_fsdp


@pytest.fixture
def dp_mesh(one_rank_group: None) -> DeviceMesh:
    return init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))


def test_bf16_fsdp_computes_in_bf16_and_keeps_fp32_shards_and_gradients(dp_mesh: DeviceMesh) -> None:
    cfg = tiny().model
    torch.manual_seed(0)
    model = Transformer(cfg)
    apply_fsdp(model, dp_mesh, zero=3, precision="bf16")
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    logits = model(ids)
    assert logits.dtype == torch.bfloat16
    cross_entropy_loss(logits, ids).backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_fp32_fsdp_computes_in_fp32(dp_mesh: DeviceMesh) -> None:
    cfg = tiny().model
    model = Transformer(cfg)
    apply_fsdp(model, dp_mesh, zero=3)
    assert model(torch.randint(0, cfg.vocab_size, (2, 16))).dtype == torch.float32
