"""Sharded data parallelism with FSDP2 (`fully_shard`), and how Fathom's ZeRO stages map onto it.

FSDP2 always shards parameters, gradients and optimizer state over the dp mesh between steps;
what it lets one choose is whether a block's parameters are freed again right after its forward
(`reshard_after_forward`). So the ZeRO stages are expressed as that one choice:

| zero | reshard_after_forward | during forward/backward                      | communication per step       |
|------|-----------------------|----------------------------------------------|------------------------------|
| 3    | True                  | only the running block's parameters are whole | all-gather ×2, reduce-scatter |
| 2    | False                 | parameters stay whole from forward to backward | all-gather ×1, reduce-scatter |
| 1    | False                 | same as 2: FSDP2 has no "shard only the optimizer" mode, so gradients are reduce-scattered (sharded) as in ZeRO-2 |

zero=0 is not FSDP: parameters are replicated and gradients all-reduced (parallel/replicate.py).
Each transformer block is its own unit so its all-gather overlaps the previous block's compute;
the embedding and the norm+head are units of their own, then the root takes what is left. A
tied embedding and head are one parameter, which belongs to one unit: the root's.

bf16 under FSDP is FSDP2's mixed precision, not autocast: the fp32 shards stay the master copy,
each unit's all-gather casts to bf16 (half the traffic) and frees the bf16 weights with the
unit, and gradients are reduce-scattered in fp32. Autocast over FSDP would gather fp32 and
keep its bf16 copies of every weight alive until backward, unsharded.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from training.model import Transformer


def reshard_after_forward(zero: int) -> bool:
    if zero not in (1, 2, 3):
        raise ValueError(f"FSDP implements zero 1, 2 or 3; got {zero}")
    return zero == 3


def mixed_precision(precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for a layout's precision: bf16 compute with fp32 gradient reduction, or none."""
    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, zero: int, precision: str = "fp32") -> None:
    """Shards `model` (or a pipeline stage of it) in place over `dp_mesh`.

    With tensor parallelism already applied the parameters are DTensors on the tp mesh, and FSDP2
    shards them further over dp (2-D: `dp_mesh` and the tp mesh must come from one DeviceMesh).
    """
    reshard = reshard_after_forward(zero)
    policy = mixed_precision(precision)
    tied = model.cfg.tie_embeddings
    if model.embed_tokens is not None and not tied:
        fully_shard(model.embed_tokens, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    if model.norm is not None and model.lm_head is not None and not tied:
        # The head runs last in forward and first in backward: keeping it whole in between saves an
        # all-gather at no memory cost worth naming (torchtitan does the same).
        fully_shard([model.norm, model.lm_head], mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
