"""Pipeline parallelism: cut the model into stages by layers and run them with a schedule.

Every rank builds a model on the meta device per stage it runs (no memory, no copy) and keeps
only that stage of it: the other layers deleted from the `layers` ModuleDict, and the embedding
(not the first stage) or the final norm and head (not the last stage) set to None. Names of what
remains are unchanged, so the state dicts of all stages together are the whole model's. The
stages get their storage and values later, shard by shard (training/initial_weights.py).

Schedules come from `torch.distributed.pipelining`: GPipe (all forwards, then all backwards),
1F1B (one forward, one backward in steady state: at most `pp` micro-batches of activations alive)
and interleaved 1F1B (several non-adjacent stages per rank, stage s on pp rank s mod pp, which
shrinks the bubble). The schedule splits each batch into micro-batches along dim 0, applies the
loss on the last stage. The loss function itself carries the 1/micro-batches factor (the
schedules' own `scale_grads` is off): scaling grads after backward would happen after the
zero=0 gradient all-reduce has already read them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    _PipelineSchedule,
)
from torch.distributed.pipelining.stage import _PipelineStageBase

from training.config import Schedule
from training.model import Transformer
from training.parallel.dims import stage_layers


def split_stage(part: Transformer, stage: int, num_stages: int) -> Transformer:
    """Cuts `part`, a whole model, down in place to what pipeline stage `stage` of `num_stages` runs."""
    owned = {str(i) for i in stage_layers(part.cfg.n_layers, num_stages)[stage]}
    for name in list(part.layers.keys()):
        if name not in owned:
            del part.layers[name]
    if stage != 0:
        part.embed_tokens = None
    if stage != num_stages - 1:
        part.norm = None
        part.lm_head = None
    return part


def build_schedule(
    parts: list[Transformer],
    stage_ids: list[int],
    num_stages: int,
    pp_group: dist.ProcessGroup,
    schedule: Schedule,
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device,
) -> _PipelineSchedule:
    stages: list[_PipelineStageBase] = [
        PipelineStage(part, stage_id, num_stages, device=device, group=pp_group)
        for part, stage_id in zip(parts, stage_ids, strict=True)
    ]
    if schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    if len(stages) != 1:
        raise ValueError(f"the {schedule} schedule runs one stage per rank; got {len(stages)}")
    single = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    return single(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
