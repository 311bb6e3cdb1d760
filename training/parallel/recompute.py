"""Activation recomputation per transformer block: trade step time for activation memory.

- none: autograd keeps every intermediate of every block.
- selective: keep the outputs of the expensive ops (matmuls, attention, tensor-parallel
  reduce-scatters) and recompute the cheap elementwise ones (norms, rotary, SiLU, products) in
  backward. Most of the memory of full recompute's saving is in those cheap, wide intermediates.
- full: keep only each block's input and rerun the whole block in backward.

Blocks are wrapped in place inside the `layers` ModuleDict. The wrapper adds a
`_checkpoint_wrapped_module.` segment to `named_parameters()`, which the state-dict hooks and DCP's
`get_state_dict` strip, so checkpoints keep the plain names. Apply after tensor parallelism (the
TP plan addresses submodules by name) and before FSDP (each FSDP unit is the wrapped block).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from training.config import Recompute
from training.model import Transformer

_aten = torch.ops.aten
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}


def _keep_expensive(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_recompute(model: Transformer, mode: Recompute) -> None:
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, checkpoint_fn=checkpoint, use_reentrant=False, preserve_rng_state=False)
        elif mode == "selective":
            wrapped = checkpoint_wrapper(
                block,
                checkpoint_fn=checkpoint,
                use_reentrant=False,
                preserve_rng_state=False,  # the model has no dropout: the recomputation draws no random numbers
                context_fn=partial(create_selective_checkpoint_contexts, _keep_expensive),
            )
        else:
            raise ValueError(f"recompute must be none, selective or full; got {mode!r}")
        model.layers[name] = wrapped
