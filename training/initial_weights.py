"""A run's first weights, written straight into each rank's shards of a model built on the meta device.

Ranks build their share of the model on the meta device (shapes, no memory), split it into
pipeline stages and shard it with TP and FSDP there, and only then allocate it: `materialize`
gives every parameter its local shard (`to_empty`) and has a weight source fill it. No rank ever
holds the whole model; the most one holds beside its shards is one slice of one parameter.

- `SeededInit` gives the values `torch.manual_seed(seed); Transformer(cfg)` gives, bit for bit,
  under every layout, and leaves the global generator where that leaves it. The eager
  constructor draws every parameter in turn from the one global generator (torch's module inits,
  a Linear's bias right after its weight, then `Transformer.reset_parameters`), so a parameter's values depend on every draw before
  it: each rank replays the whole sequence of draws, a slab of rows at a time, and keeps the
  rows and columns of its own shards. CPU draws are sequential per element (`uniform_` one
  32-bit draw each; `normal_` the same, transformed 16 at a time, the last 16 redrawn when the
  count is not a multiple of 16), so slabs whose sizes are multiples of 16 draw exactly what
  the whole tensor draws (tests/training/test_initial_weights.py checks it).
- `PretrainedWeights` reads each shard's slice of each tensor from a Hugging Face folder's
  safetensors (`safe_open(...).get_slice`), one tensor at a time. A tied output head is the
  embedding's parameter (`named_parameters` names it once), so it reads nothing of its own.
- `LoraWeights` (a LoRA run) reads the base as `PretrainedWeights` does and starts the adapters
  as PEFT does (A kaiming-uniform, B zero), each A drawn whole from a generator of its own
  seeded by the run's seed and the adapter's name, so every layout starts from the same values.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from training.config import LoraConfig, ModelConfig, RunSpec
from training.model import Transformer, init_lora_a, is_adapter
from training.pretrained import hf_name, tensor_files

# Elements per slab of draws: small beside any model worth building on meta (32 MB of fp32),
# large enough that the per-slab overhead is nothing beside the drawing itself.
SLAB_ELEMENTS = 8 * 1024 * 1024
# What recompute's wrapper inserts into parameter names (training/parallel/recompute.py).
_WRAPPER_SEGMENT = "_checkpoint_wrapped_module."

Box = tuple[slice, ...]


class WeightSource(Protocol):
    def fill(self, shards: dict[str, LocalShard]) -> None:
        """Writes every shard's values; `shards` holds this rank's, by the model's parameter name."""


class LocalShard:
    """This rank's part of one parameter: the box of the full tensor it holds, and where it lives."""

    def __init__(self, param: torch.Tensor) -> None:
        self.full_shape = tuple(param.shape)
        if isinstance(param, DTensor):
            # The same arithmetic DCP uses to place a DTensor's local chunk in the global tensor,
            # under TP, FSDP (uneven chunks included) and both.
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            self.local = param.to_local()  # under no_grad: the local tensor itself, not a copy
        else:
            shape, offset = self.full_shape, (0,) * param.ndim
            self.local = param
        self.box: Box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))

    @torch.no_grad()
    def write_rows(self, first_row: int, rows: torch.Tensor) -> None:
        """Copies what this shard holds of the full tensor's rows [first_row, first_row + len(rows))."""
        start = max(first_row, self.box[0].start)
        stop = min(first_row + rows.shape[0], self.box[0].stop)
        if start >= stop:
            return
        piece = rows[(slice(start - first_row, stop - first_row), *self.box[1:])]
        self.local[start - self.box[0].start : stop - self.box[0].start].copy_(piece)


def canonical_name(name: str) -> str:
    """A parameter's name in the unwrapped model (checkpoint and export names)."""
    return name.replace(_WRAPPER_SEGMENT, "")


def build_meta(cfg: ModelConfig, lora: LoraConfig | None = None) -> Transformer:
    """The model's structure with no storage: every parameter and buffer on the meta device."""
    with torch.device("meta"):
        return Transformer(cfg, lora)


@torch.no_grad()
def materialize(parts: list[Transformer], device: torch.device, source: WeightSource) -> None:
    """Allocates the meta-built, already sharded `parts` on `device` and fills them from `source`.

    Parameter objects are replaced by `to_empty`: hooks on parameters and optimizers must come after.
    """
    shards: dict[str, LocalShard] = {}
    for part in parts:
        part.to_empty(device=device)
        part.tie_weights()  # to_empty gave the head a parameter of its own where it was tied
        part.reset_buffers()
        for name, param in part.named_parameters():
            shards[canonical_name(name)] = LocalShard(param)
    source.fill(shards)


def slabs(shape: tuple[int, ...], draw: Callable[[torch.Tensor], object]) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, rows) of a tensor of `shape` drawn a slab of rows at a time; see the module docstring."""
    rows = shape[0]
    per_row = math.prod(shape[1:])
    # Whole rows, and a multiple of 16 elements in all; the last slab takes the remainder, and has
    # at least one full slab's rows, so it is never under 16 elements either.
    step = 16 // math.gcd(per_row, 16)
    slab_rows = max(step, SLAB_ELEMENTS // max(per_row, 1) // step * step)
    count = max(1, rows // slab_rows)
    for i in range(count):
        start = i * slab_rows
        stop = rows if i == count - 1 else start + slab_rows
        slab = torch.empty((stop - start, *shape[1:]))
        draw(slab)
        yield start, slab


def _constructor_draws(module: nn.Module) -> list[tuple[tuple[int, ...], Callable[[torch.Tensor], object]]]:
    """The (shape, draw) of each tensor torch's own init of `module` draws from the global
    generator, in its order: an Embedding's weight; a Linear's weight, then its bias."""
    if isinstance(module, nn.Embedding):
        return [(tuple(module.weight.shape), lambda t: t.normal_())]
    if isinstance(module, nn.Linear):
        bound = 1.0 / math.sqrt(module.in_features)  # kaiming_uniform_(a=√5)'s and the bias's bound
        draws: list[tuple[tuple[int, ...], Callable[[torch.Tensor], object]]] = [
            (tuple(module.weight.shape), lambda t: t.uniform_(-bound, bound))
        ]
        if module.bias is not None:
            draws.append(((module.out_features,), lambda t: t.uniform_(-bound, bound)))
        return draws
    return []


def _normal(std: float) -> Callable[[torch.Tensor], object]:
    return lambda t: t.normal_(0.0, std)


class SeededInit:
    """The eager model's initial values for `seed`, replayed into shards (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, seed: int) -> None:
        self.cfg = cfg
        self.seed = seed

    def fill(self, shards: dict[str, LocalShard]) -> None:
        reference = build_meta(self.cfg)
        torch.manual_seed(self.seed)
        # 1. The draws of nn.Embedding's and nn.Linear's constructors, which reset_parameters
        #    overwrites but which move the generator: drawn and dropped. A tied head's Linear drew
        #    its own weight before the tie replaced it, so it is drawn here too.
        for module in reference.modules():
            for shape, draw in _constructor_draws(module):
                for _ in slabs(shape, draw):
                    pass
        # 2. Transformer.reset_parameters, parameter by parameter; every rank draws every
        #    parameter, its own or not, to stay in step with the eager sequence.
        for name, param in reference.named_parameters():
            shape = tuple(param.shape)
            shard = shards.get(name)
            std = reference.init_std(name, param.ndim)
            if std is None:
                if shard is not None:
                    shard.local.fill_(reference.init_constant(name))
                continue
            for first_row, rows in slabs(shape, _normal(std)):
                if shard is not None:
                    shard.write_rows(first_row, rows)


class PretrainedWeights:
    """The tensors of a Hugging Face folder (training/pretrained.py), each rank reading only its shards' slices."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.folder = folder
        self.seed = seed

    def fill(self, shards: dict[str, LocalShard]) -> None:
        from safetensors import safe_open

        torch.manual_seed(self.seed)  # whatever draws after the init starts where a scratch run's would
        files = tensor_files(self.folder)
        for name, shard in shards.items():
            stored = hf_name(name)
            if stored not in files:
                raise ValueError(f"{self.folder} holds no tensor {stored}")
            with safe_open(str(files[stored]), framework="pt") as f:
                piece = f.get_slice(stored)
                if tuple(piece.get_shape()) != shard.full_shape:
                    raise ValueError(
                        f"{self.folder}: {stored} has shape {tuple(piece.get_shape())}; the model needs {shard.full_shape}"
                    )
                shard.local.copy_(piece[shard.box])  # reads only this box of the file, in its stored dtype


class LoraWeights:
    """A LoRA run's first weights: the base from its pretrained folder, the adapters as PEFT starts them."""

    def __init__(self, base: PretrainedWeights, seed: int) -> None:
        self.base = base
        self.seed = seed

    def fill(self, shards: dict[str, LocalShard]) -> None:
        self.base.fill({name: shard for name, shard in shards.items() if not is_adapter(name)})
        for name, shard in shards.items():
            if not is_adapter(name):
                continue
            if name.endswith("lora_B.weight"):
                shard.local.zero_()
                continue
            # Drawn whole (rank × in is small) from a generator of its own, never the global one,
            # whose state after the init must be a full fine-tune's. crc32, not hash(): Python
            # salts str hashes per process, and every rank must draw the same.
            generator = torch.Generator().manual_seed(self.seed ^ zlib.crc32(name.encode()))
            whole = init_lora_a(torch.empty(shard.full_shape), generator)
            shard.local.copy_(whole[shard.box])


def initial_weights(spec: RunSpec) -> WeightSource:
    """Where a run's first weights come from (a resumed run then overwrites them from its checkpoint)."""
    if spec.lora.enabled:
        return LoraWeights(PretrainedWeights(Path(spec.data.pretrained), spec.train.seed), spec.train.seed)
    if spec.data.pretrained:
        return PretrainedWeights(Path(spec.data.pretrained), spec.train.seed)
    return SeededInit(spec.model, spec.train.seed)
