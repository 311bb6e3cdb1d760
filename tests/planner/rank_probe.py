"""Measures, inside a training rank, what the planner estimates: bytes held and bytes sent.

- `TrafficCounter` is a TorchDispatchMode that sees every collective the rank issues, whoever
  issues it: `c10d.*` ops (torch.distributed calls from FSDP2, the gradient all-reduce, pipeline
  sends) and `_c10d_functional.*` ops (DTensor's tensor-parallel redistributions). It turns each
  into the bytes this rank sends in a ring algorithm and files them under the mesh dimension whose
  group it ran on.
- `ActivationPeak` (the same mechanism) tracks every storage created by a forward op (not in
  backward, so not gradients and not recomputation) and samples, after each forward op, how many
  bytes of them are still alive: the peak is what forward leaves for backward, over whatever
  schedule of micro-batches runs. Weights are told apart: parameter storages (views of weights,
  FSDP's gathered weights) and autocast's casts of parameters are reported on their own.
- `state_bytes` reads the weights and optimizer states; `GradTap` the gradients just before the
  optimizer step (the trainer frees them right after).

Everything counts local tensors: a DTensor contributes its shard.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from training.parallel.dims import MESH_DIMS, ParallelDims


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


def nbytes(t: torch.Tensor) -> int:
    loc = local(t)
    return loc.numel() * loc.element_size()


def storage_ptr(t: torch.Tensor) -> int | None:
    """Address of the storage behind `t`, or None for tensors without one of their own (a pending
    functional collective's wrapper, meta tensors)."""
    try:
        return local(t).untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def mesh_groups(dims: ParallelDims, rank: int) -> dict[str, frozenset[int]]:
    """The ranks of this rank's group along each mesh dimension."""
    coords = dims.coordinates(rank)
    groups: dict[str, frozenset[int]] = {}
    for dim in MESH_DIMS:
        members = [
            r for r in range(dims.world_size) if all(dims.coordinates(r)[d] == coords[d] for d in MESH_DIMS if d != dim)
        ]
        groups[dim] = frozenset(members)
    return groups


def _ring_bytes(op: str, tensors: list[torch.Tensor], n: int) -> float:
    """Bytes this rank sends for collective `op` over n ranks, given its input tensors."""
    size = float(sum(nbytes(t) for t in tensors))
    if n <= 1:
        return 0.0
    if "all_reduce" in op or "allreduce" in op:
        return 2 * (n - 1) / n * size
    if "gather" in op:  # the input is this rank's shard; it reaches n-1 peers
        return (n - 1) * size
    if "reduce_scatter" in op:  # the input is whole; n-1 of its n slices leave
        return (n - 1) / n * size
    if op == "send":
        return size
    return 0.0


# Input positions of the collectives that move data this rank sends; others (waits, recv, barrier) send nothing.
_INPUTS = {
    "allreduce_": 0,
    "allreduce_coalesced_": 0,
    "_allgather_base_": 1,
    "allgather_": 1,
    "allgather_into_tensor_coalesced_": 1,
    "_reduce_scatter_base_": 1,
    "reduce_scatter_": 1,
    "reduce_scatter_tensor_coalesced_": 1,
    "send": 0,
    "all_reduce": 0,
    "all_reduce_coalesced": 0,
    "all_gather_into_tensor": 0,
    "all_gather_into_tensor_coalesced": 0,
    "reduce_scatter_tensor": 0,
    "reduce_scatter_tensor_coalesced": 0,
}
_SILENT = {"wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"}


class TrafficCounter(TorchDispatchMode):
    """Bytes sent per mesh dimension ("dp", "tp", "pp"; "world" for whole-world groups that are no
    mesh dimension), and the number of collectives."""

    def __init__(self, groups: dict[str, frozenset[int]], world_size: int) -> None:
        super().__init__()
        self.groups = groups
        self.world = frozenset(range(world_size))
        self.sent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.by_op: dict[str, float] = defaultdict(float)  # "tp all_gather_into_tensor" → bytes
        self.unknown: set[str] = set()

    def _dimension(self, ranks: frozenset[int]) -> str:
        for dim in ("tp", "dp", "pp"):  # a 1-wide dimension never communicates, so ties do not arise
            if len(self.groups[dim]) > 1 and ranks == self.groups[dim]:
                return dim
        return "world" if ranks == self.world else "other"

    def _ranks(self, args: Iterable[Any]) -> frozenset[int] | None:
        for a in args:
            if isinstance(a, str):
                try:  # a functional collective names its group
                    pg = dist.distributed_c10d._resolve_process_group(a)  # type: ignore[arg-type]
                except Exception:  # a string argument that is not a group name
                    continue
                return frozenset(dist.get_process_group_ranks(pg))
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except RuntimeError:  # a ReduceOp or another custom class
                    continue
                return frozenset(dist.get_process_group_ranks(pg))
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._opname
            if name in _INPUTS:
                ranks = self._ranks(args)
                if ranks is None:
                    self.unknown.add(name)
                else:
                    tensors, _ = tree_flatten(args[_INPUTS[name]])
                    dim = self._dimension(ranks)
                    op = "send" if name == "send" else name
                    sent = _ring_bytes(op, [t for t in tensors if isinstance(t, torch.Tensor)], len(ranks))
                    self.sent[dim] += sent
                    self.by_op[f"{dim} {name}"] += sent
                    self.calls[dim] += 1
            elif name not in _SILENT:
                self.unknown.add(name)
        return out


# The non-functional collectives FSDP2 runs (the pipeline uses send/recv, tensor parallelism DTensor's
# functional collectives, and the zero-0 all-reduce runs in backward).
_FSDP_COLLECTIVES = {
    "_allgather_base_",
    "allgather_into_tensor_coalesced_",
    "_reduce_scatter_base_",
    "reduce_scatter_tensor_coalesced_",
}


class ActivationPeak(TorchDispatchMode):
    """Peak bytes of forward-created storages alive at once, without weights and their copies."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.modules = modules
        self.enabled = True  # switched off before the optimizer step, whose temporaries are not activations
        self.tracked: dict[int, tuple[weakref.ref[torch.UntypedStorage], str]] = {}
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def _param_storages(self) -> set[int]:
        return {storage_ptr(p) for m in self.modules for p in m.parameters()} - {None}  # type: ignore[return-value]

    def _track(self, t: torch.Tensor, kind: str) -> None:
        ptr = storage_ptr(t)
        if not ptr:
            return
        storage = local(t).untyped_storage()
        known = self.tracked.get(ptr)
        # The allocator reuses the address of a storage freed during this very op: replace the dead entry.
        if known is None or known[0]() is not storage:
            if known is None or known[0]() is None:
                self.tracked[ptr] = (weakref.ref(storage), kind)

    def sample(self) -> None:
        params = self._param_storages()
        alive: dict[str, int] = defaultdict(int)
        for ptr, (ref, kind) in list(self.tracked.items()):
            storage = ref()
            if storage is None or storage.data_ptr() != ptr:
                del self.tracked[ptr]
                continue
            alive["weights" if ptr in params else kind] += storage.nbytes()
        if alive["activations"] > self.peak:
            self.peak = alive["activations"]
            self.at_peak = dict(alive)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if not self.enabled or torch._C._current_graph_task_id() != -1:  # backward: gradients, recomputation
            return out
        if func.namespace == "c10d" and func._opname in _FSDP_COLLECTIVES:
            # FSDP's flat all-gather / reduce-scatter buffers: working memory for weights, not activations.
            for t in tree_flatten(args)[0]:
                ptr = storage_ptr(t) if isinstance(t, torch.Tensor) else None
                if ptr in self.tracked:
                    self.tracked[ptr] = (self.tracked[ptr][0], "FSDP buffers")
            return out
        kind = "activations"
        if func is torch.ops.aten._to_copy.default and args and isinstance(args[0], nn.Parameter):
            kind = "weight copies"  # autocast's bf16 cast of a weight
        inputs = {storage_ptr(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            # Only storages this op allocated: a view or an in-place result belongs to its input.
            if isinstance(t, torch.Tensor) and storage_ptr(t) not in inputs:
                self._track(t, kind)
        self.sample()
        return out

    def stop(self) -> None:
        """Backward is over: what is made from here on (gradient reduction, clipping) is not activation."""
        self.enabled = False


class GradTap:
    """Records the gradient bytes of `params` when any of `optimizers` steps, and stops `peak`."""

    def __init__(
        self, optimizers: list[torch.optim.Optimizer], params: list[nn.Parameter], peak: ActivationPeak
    ) -> None:
        self.grad_bytes = 0
        self._originals: list[tuple[torch.optim.Optimizer, Any]] = []
        for opt in optimizers:
            original = opt.step
            self._originals.append((opt, original))

            def step(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                peak.stop()
                # One optimizer per pipeline stage, each zeroing its gradients after its step: the
                # first call sees them all.
                held = sum(nbytes(p.grad) for p in params if p.grad is not None)
                self.grad_bytes = max(self.grad_bytes, held)
                return _original(*args, **kwargs)

            opt.step = step  # type: ignore[method-assign]

    def close(self) -> None:
        for opt, original in self._originals:
            opt.step = original  # type: ignore[method-assign]


def state_bytes(params: list[nn.Parameter], optimizers: list[torch.optim.Optimizer]) -> tuple[int, int]:
    """(weight bytes, optimizer-state bytes) this rank holds."""
    weights = sum(nbytes(p) for p in params)
    optimizer = sum(
        nbytes(v)
        for opt in optimizers
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )
    return weights, optimizer
