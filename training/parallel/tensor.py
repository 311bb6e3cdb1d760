"""Tensor parallelism with sequence parallelism (Megatron-style), as a torchtitan-like plan.

Between blocks the residual stream is split along the sequence (Shard(1)): norms run on each
rank's slice. Attention and the MLP gather the full sequence at their input (PrepareModuleInput),
split heads / hidden columns across ranks (Colwise), and reduce-scatter their output back to
sequence slices (Rowwise with output Shard(1)). The embedding is split by vocabulary rows and the
output head by vocabulary columns; the head's logits are gathered (Replicate) so the loss, and a
pipeline schedule's loss function, see ordinary full-vocabulary logits.

Qwen2's q, k, v biases are split with their columns (ColwiseParallel shards a bias with its
weight's output features). Qwen3's per-head norms of q and k hold one gain per element of a head,
shared by all heads: each rank applies them to its own heads, so they are replicated parameters
whose gradient is each rank's heads' share: `SequenceParallel(sequence_dim=2)` views the local
(B, T, local heads, head_dim) tensor as split along the heads, and DTensor then sums the gains'
gradient over tp (torchtitan's Qwen3 plan does the same).

A tied head (model.tie_embeddings) is the embedding's parameter: both plans split its rows by
vocabulary (Shard(0)), but each distributes its module's parameter anew, so the tie is made again
on the one DTensor after parallelizing; the gradient of both uses accumulates into it.

LoRA adapters (model.LoraAdapter: A then B) are split to match their layer, so each rank adds
its update to exactly the output it holds:
- a column-parallel layer (q, k, v, gate, up) splits its output rows: B is split the same way
  (Colwise) and A (rank × in) is replicated (`ReplicateParallel`), applied to the replicated
  input the layer itself reads: no communication forward. Backward, the gradient reaching A's
  output is each rank's partial sum (its B rows' share), so A's gradient is partial too, and
  DTensor sums it over tp (rank × in, small); the input's gradient joins the layer's own partial
  one, reduce-scattered once with it.
- a row-parallel layer (o, down) splits its input columns: A is split by input columns
  (Rowwise), its partial (B, T, rank) products reduce-scattered to sequence slices as o_proj's
  output is, and B is replicated and applied to the slice (`SequenceParallel`); B's gradient,
  again a partial sum over the slices, is summed over tp by DTensor.

DTensor's embedding backward returns the vocabulary-split weight's gradient whole (Replicate):
`keep_embedding_grad_sharded` cuts it back to this rank's rows as soon as it is accumulated, so
it is neither kept nor all-reduced over dp whole.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from training.model import ADAPTERS, Transformer

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")


class ReplicateParallel(ParallelStyle):
    """Every parameter of the module replicated over tp; its input must already be a replicated
    DTensor, and its output stays one. torch's styles all shard something, or (SequenceParallel)
    move the input onto sequence slices."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            # from_local, not distribute_tensor: the model is on the meta device here (nothing to
            # broadcast), and every rank fills its copy with the same values at materialisation.
            replicated = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        return module


def adapter_plan(model: Transformer) -> dict[str, object]:
    """The styles of one block's adapters (module docstring), by their names in the block."""
    if model.lora is None:
        return {}
    plan: dict[str, object] = {}
    for name in model.lora.targets:
        owner = "mlp" if name.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
        prefix = f"{owner}.{ADAPTERS}.{name}"
        if name in COLUMN_PARALLEL:
            plan[f"{prefix}.lora_A"] = ReplicateParallel()
            plan[f"{prefix}.lora_B"] = ColwiseParallel()
        else:
            plan[f"{prefix}.lora_A"] = RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
            plan[f"{prefix}.lora_B"] = SequenceParallel(use_local_output=True)
    return plan


def apply_tp(model: Transformer, tp_mesh: DeviceMesh) -> None:
    """Shards `model` (or a pipeline stage of it) in place over `tp_mesh`."""
    root_plan: dict[str, object] = {}
    if model.embed_tokens is not None:
        root_plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        root_plan["norm"] = SequenceParallel()
    if model.lm_head is not None:
        root_plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)  # type: ignore[arg-type]
        model.tie_weights()

    for block in model.layers.values():
        block_plan = {
            "input_layernorm": SequenceParallel(),
            # Block inputs: (hidden, rope_cos, rope_sin); only the hidden states are sharded.
            "self_attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None),
                desired_input_layouts=(Replicate(), None, None),
            ),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            **(
                {
                    "self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                    "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                }
                if model.cfg.qk_norm
                else {}
            ),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            **adapter_plan(model),
        }
        parallelize_module(block, tp_mesh, block_plan)  # type: ignore[arg-type]


def keep_embedding_grad_sharded(model: Transformer) -> None:
    """After each accumulation into the TP embedding's gradient, keeps only this rank's vocabulary
    rows of it, the weight's own placement (a local slice: no communication, the same values).

    For TP without FSDP: FSDP2 reduces the gradients itself and replaces the parameters this hook
    would be registered on. Registered before the zero=0 all-reduce hooks, it runs before them.
    """
    if model.embed_tokens is None or not model.embed_tokens.weight.requires_grad:
        return  # a LoRA run's frozen embedding has no gradient to keep sharded

    @torch.no_grad()
    def reshard(weight: torch.Tensor) -> None:
        grad = weight.grad
        if isinstance(weight, DTensor) and isinstance(grad, DTensor) and grad.placements != weight.placements:
            weight.grad = grad.redistribute(weight.device_mesh, weight.placements)

    model.embed_tokens.weight.register_post_accumulate_grad_hook(reshard)
