"""Plain data parallelism (zero=0): replicated parameters, gradients all-reduced during backward.

Each parameter's post-accumulate-grad hook marks it ready; when every parameter of a bucket is
ready, the bucket's gradients are flattened and all-reduced with `async_op=True`, so the reduction
of late layers runs while autograd still computes early layers. `finish()` waits for every bucket
and writes the averaged gradients back; the trainer calls it before clipping and `optimizer.step()`.

A parameter's gradient is complete only after its last accumulation of the step: one per
micro-batch of a pipeline schedule and per gradient-accumulation pass. The hook counts them, so
the reduction starts exactly when the last contribution has landed, whatever the schedule.

With `overlap=False` (`layout.overlap_grad_reduce: false`) every bucket is reduced in `finish()`,
after backward: the step then pays the whole reduction on top of compute, which is what a
profile without overlap should show, and what the planner prices.

With tensor parallelism the parameters are DTensors; their local shards are reduced over dp only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Bucket size: big enough that per-call overhead is amortised, small enough that the first bucket
# is ready while most of backward is still to run (DDP's default is 25 MiB).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    pending: int = 0  # parameters not yet ready this step
    work: dist.Work | None = None
    flat: torch.Tensor | None = None
    grads: list[torch.Tensor] = field(default_factory=list)


class GradientAllReduce:
    """Averages gradients over `group`, overlapping the reduction with backward unless told not to."""

    def __init__(
        self,
        modules: list[nn.Module],
        group: dist.ProcessGroup,
        accumulations_per_step: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool = True,
    ) -> None:
        self.group = group
        self.overlap = overlap
        self.size = dist.get_world_size(group)
        self.accumulations_per_step = accumulations_per_step
        params = [p for m in modules for p in m.parameters() if p.requires_grad]
        # Backward reaches the last parameters first, so buckets are filled in reverse order.
        self.buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        size = 0
        for p in reversed(params):
            current.append(p)
            size += _local(p).numel() * _local(p).element_size()
            if size >= bucket_bytes:
                self.buckets.append(_Bucket(current))
                current, size = [], 0
        if current:
            self.buckets.append(_Bucket(current))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._seen = {id(p): 0 for p in params}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.work, bucket.flat, bucket.grads = None, None, []
        for key in self._seen:
            self._seen[key] = 0

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        key = id(param)
        self._seen[key] += 1
        if self._seen[key] < self.accumulations_per_step:
            return
        bucket = self._bucket_of[key]
        bucket.pending -= 1
        if bucket.pending == 0 and self.overlap:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        for p in bucket.params:
            if p.grad is None:  # unused this step: it still takes part, as zeros, on every rank
                p.grad = torch.zeros_like(p)
        bucket.grads = [_local(p.grad) for p in bucket.params]  # type: ignore[arg-type]
        bucket.flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        bucket.work = dist.all_reduce(bucket.flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    @torch.no_grad()
    def finish(self) -> None:
        """Waits for every reduction and leaves each parameter's .grad the dp average."""
        for bucket in self.buckets:
            if bucket.work is None:  # not overlapped, or a parameter got no gradient this step (unused)
                self._launch(bucket)
            assert bucket.work is not None and bucket.flat is not None
            bucket.work.wait()
            bucket.flat.div_(self.size)
            offset = 0
            for g in bucket.grads:
                n = g.numel()
                g.copy_(bucket.flat[offset : offset + n].view_as(g))
                offset += n
        self._reset()


def apply_replicate(
    modules: list[nn.Module], dp_group: dist.ProcessGroup, accumulations_per_step: int, overlap: bool = True
) -> GradientAllReduce:
    return GradientAllReduce(modules, dp_group, accumulations_per_step, overlap=overlap)
