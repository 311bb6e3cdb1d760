"""Composes Fathom's parallelisms on one ("pp", "dp", "tp") device mesh.

`parallelize` applies them in a fixed order, each step relying on the one before:

1. pipeline split (pipeline.py): build this rank's stages on the meta device, nothing else;
2. tensor parallelism (tensor.py): shard each stage's weights over tp, by submodule name; a LoRA
   run then freezes its base again (distributing made every parameter trainable), so that FSDP
   and the optimizer see only the adapters as trainable;
3. activation recompute (recompute.py): wrap the TP-sharded blocks;
4. FSDP2 (fsdp.py, zero 1–3): shard the wrapped blocks' (DTensor) parameters over dp, in bf16
   mixed precision when the layout asks for bf16 (the trainer autocasts only without FSDP);
5. materialisation (training/initial_weights.py): allocate only the local shards on the device
   and fill them from the weight source (the seeded init, or a pretrained folder);
6. hooks on the final parameter objects (`to_empty` replaced them): TP's embedding gradient
   resharding, and the gradient all-reduce (replicate.py, zero 0 with dp > 1);
7. the pipeline schedule (pipeline.py) over the finished stage modules.

Only dimensions larger than 1 are applied. Steps 1–4 cost no memory; no rank ever holds the
whole model. The seeded source replays the single-process init draw for draw, so each parallel
layout starts from exactly the weights of the single-process run.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from training.config import RunSpec
from training.initial_weights import WeightSource, build_meta, materialize
from training.model import Transformer
from training.parallel.dims import ParallelDims, batch_shape
from training.parallel.fsdp import apply_fsdp
from training.parallel.recompute import apply_recompute
from training.parallel.replicate import GradientAllReduce, apply_replicate
from training.parallel.tensor import apply_tp, keep_embedding_grad_sharded

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import _PipelineSchedule


@dataclass
class ParallelModel:
    parts: list[Transformer]  # this rank's pipeline stages (the whole model without PP)
    schedule: _PipelineSchedule | None  # None without PP
    has_first_stage: bool
    has_last_stage: bool
    grad_sync: GradientAllReduce | None  # zero=0 with dp > 1


def parallelize(
    weights: WeightSource,
    spec: RunSpec,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    rank: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | None = None,
) -> ParallelModel:
    """This rank's share of the `spec.model` model, parallelized in the order of the module docstring,
    its shards on `device` (default: the CPU) holding the values `weights` gives them.

    `loss_fn(logits, targets)` is what a pipeline schedule applies to each micro-batch on the last
    stage; it must already divide by the number of micro-batches (the schedule does not scale).
    """
    device = device or torch.device("cpu")
    coords = dims.coordinates(rank)
    lay = spec.layout
    if dims.pp > 1:
        # Imported here: torch's pipelining brings in TorchDynamo, a second of every rank's start
        # that runs without a pipeline do not need.
        from training.parallel.pipeline import build_schedule, split_stage

        stage_ids = dims.stage_ids(coords["pp"])
        parts = [split_stage(build_meta(spec.model, spec.lora), s, dims.num_stages) for s in stage_ids]
    else:
        stage_ids, parts = [0], [build_meta(spec.model, spec.lora)]
    for part in parts:
        if dims.tp > 1:
            assert mesh is not None
            apply_tp(part, mesh["tp"])
            part.freeze_base()
        apply_recompute(part, lay.recompute)
        if dims.fsdp_enabled:
            assert mesh is not None
            apply_fsdp(part, mesh["dp"], dims.zero, lay.precision)
    materialize(parts, device, weights)
    if dims.tp > 1 and not dims.fsdp_enabled:
        for part in parts:
            keep_embedding_grad_sharded(part)
    grad_sync = None
    if dims.replicate_enabled:
        assert mesh is not None
        grad_sync = apply_replicate(
            list(parts), mesh["dp"].get_group(), batch_shape(spec).backward_passes, spec.layout.overlap_grad_reduce
        )
    schedule = None
    if dims.pp > 1:
        assert mesh is not None
        schedule = build_schedule(
            parts,
            stage_ids,
            dims.num_stages,
            mesh["pp"].get_group(),
            lay.schedule,
            lay.microbatches,
            loss_fn,
            device,
        )
    return ParallelModel(
        parts=parts,
        schedule=schedule,
        has_first_stage=0 in stage_ids,
        has_last_stage=dims.num_stages - 1 in stage_ids,
        grad_sync=grad_sync,
    )


@torch.no_grad()
def clip_grad_norm_(
    params: Iterable[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Clips to the global L2 norm of all gradients, over every tp, dp and pp shard; returns it.

    DTensor gradients (TP, FSDP) give a DTensor norm whose `full_tensor()` already sums over their
    mesh; pipeline stages hold disjoint parameters, so their squared norms are summed over pp.
    `max_norm <= 0` only measures.
    """
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if pp_group is not None:
        squared = total.pow(2)
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=pp_group)
        total = squared.sqrt()
    if max_norm > 0 and math.isfinite(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
