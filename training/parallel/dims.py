"""Degrees of parallelism and the arithmetic on them, apart from building anything.

Everything here is plain arithmetic, unit-tested without processes: which ranks form which group,
how many layers each pipeline stage owns, what each rank's batch is. `build_mesh` is the one place
that turns the degrees into a torch `DeviceMesh`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from training.config import LayoutConfig, RunSpec

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

# Outermost to innermost. Neighbouring ranks (same host, fastest links) share the innermost
# dimension, so TP, which communicates inside every layer, goes last; PP, which only passes
# activations between stages, goes first (torchtitan's order, without context parallelism).
MESH_DIMS = ("pp", "dp", "tp")


class LayoutError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    dp: int
    tp: int
    pp: int
    world_size: int
    zero: int = 0  # 0: replicate with all-reduce; 1–3: FSDP2 over dp (see parallel/fsdp.py)
    stages_per_rank: int = 1  # virtual pipeline stages per rank (interleaved schedule)

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "world_size", "stages_per_rank"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name} must be ≥ 1; got {getattr(self, name)}")
        if self.dp * self.tp * self.pp != self.world_size:
            raise LayoutError(
                f"dp·tp·pp = {self.dp}·{self.tp}·{self.pp} = {self.dp * self.tp * self.pp} "
                f"must equal the world size {self.world_size}"
            )
        if self.zero not in (0, 1, 2, 3):
            raise LayoutError(f"zero must be 0, 1, 2 or 3; got {self.zero}")
        if self.zero and self.dp == 1:
            raise LayoutError(f"zero={self.zero} shards over dp, which is 1")

    @classmethod
    def from_layout(cls, layout: LayoutConfig, world_size: int) -> ParallelDims:
        return cls(
            dp=layout.dp,
            tp=layout.tp,
            pp=layout.pp,
            world_size=world_size,
            zero=layout.zero,
            stages_per_rank=layout.stages_per_rank,
        )

    @property
    def fsdp_enabled(self) -> bool:
        return self.zero > 0

    @property
    def replicate_enabled(self) -> bool:
        """Plain data parallelism: whole gradients all-reduced over dp."""
        return self.dp > 1 and self.zero == 0

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension (row-major over MESH_DIMS)."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside 0..{self.world_size - 1}")
        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        coords: dict[str, int] = {}
        for name in reversed(MESH_DIMS):
            coords[name] = rank % sizes[name]
            rank //= sizes[name]
        return coords

    def replicas(self, rank: int) -> list[int]:
        """The ranks that hold the same parameters and optimizer state as `rank`: its dp peers
        under plain data parallelism, none but itself when ZeRO/FSDP shards the state over dp."""
        if not self.replicate_enabled:
            return [rank]
        coords = self.coordinates(rank)
        return [r for r in range(self.world_size) if {**self.coordinates(r), "dp": coords["dp"]} == coords]

    def stage_ids(self, pp_rank: int) -> list[int]:
        """Pipeline stages on pp rank r: r, r+pp, r+2·pp, … (looped, as the interleaved schedule expects)."""
        return [pp_rank + i * self.pp for i in range(self.stages_per_rank)]

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        sizes = {"pp": self.pp, "dp": self.dp, "tp": self.tp}
        return init_device_mesh(device_type, tuple(sizes[d] for d in MESH_DIMS), mesh_dim_names=MESH_DIMS)


def stage_layers(n_layers: int, num_stages: int) -> list[list[int]]:
    """Contiguous layer indices of each pipeline stage; the first stages take one extra when uneven.

    The first and last stages also hold the embedding and the output head, so on deep models one
    would shift a layer away from them; at Fathom's sizes an even split is the simpler rule.
    """
    if not 1 <= num_stages <= n_layers:
        raise LayoutError(f"{num_stages} pipeline stages need between 1 and n_layers={n_layers} stages")
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for stage in range(num_stages):
        count = base + (1 if stage < extra else 0)
        out.append(list(range(start, start + count)))
        start += count
    return out


@dataclass(frozen=True, kw_only=True)
class BatchShape:
    """How one optimizer step's global batch is cut up on each rank."""

    local_batch: int  # sequences per dp rank per step
    micro_batch: int  # sequences per forward/backward (per grad-accumulation pass)
    pipeline_chunk: int  # sequences per pipeline micro-batch (= micro_batch without PP)
    backward_passes: int  # backward passes per step, each adding to every gradient once


def batch_shape(spec: RunSpec) -> BatchShape:
    """The per-rank batch sizes; RunSpec has already checked that every division is exact."""
    lay, t = spec.layout, spec.train
    local = t.global_batch // lay.dp
    micro = local // t.grad_accum
    pipelined = lay.pp > 1
    chunk = micro // lay.microbatches if pipelined else micro
    passes = t.grad_accum * (lay.microbatches if pipelined else 1)
    return BatchShape(local_batch=local, micro_batch=micro, pipeline_chunk=chunk, backward_passes=passes)
