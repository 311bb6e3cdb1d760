"""Tensor parallelism keeps the vocabulary-split embedding's gradient split, with the same values."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from training.config import tiny
from training.model import Transformer, cross_entropy_loss
from training.parallel.tensor import apply_tp, keep_embedding_grad_sharded


def test_the_embedding_gradient_keeps_the_weights_vocabulary_split_across_accumulations(
    one_rank_group: None,
) -> None:
    cfg = tiny().model
    torch.manual_seed(0)
    reference = Transformer(cfg)
    model = Transformer(cfg)
    model.load_state_dict(reference.state_dict())
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    apply_tp(reference, mesh)
    apply_tp(model, mesh)
    keep_embedding_grad_sharded(model)
    for _ in range(2):  # the second pass accumulates into the already split gradient
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        cross_entropy_loss(reference(ids), ids).backward()
        cross_entropy_loss(model(ids), ids).backward()
    weight, grad = model.embed_tokens.weight, model.embed_tokens.weight.grad  # type: ignore[union-attr]
    assert isinstance(weight, DTensor) and isinstance(grad, DTensor)
    assert grad.placements == weight.placements
    expected = reference.embed_tokens.weight.grad  # type: ignore[union-attr]
    assert isinstance(expected, DTensor)
    assert torch.equal(grad.full_tensor(), expected.full_tensor())
