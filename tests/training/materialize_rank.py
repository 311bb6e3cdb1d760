"""One torchrun rank that builds a layout's share of the model on the meta device, materialises it
from the spec's weight source, and checks every shard against the whole tensors it should hold:
the eager model of the same seed, or the tensors of the spec's pretrained folder read whole.

    torchrun --standalone --nproc-per-node N tests/training/materialize_rank.py SPEC.json OUT_DIR

Writes OUT_DIR/rank<R>.json: the parameters this rank holds, those whose gathered values differ
from `torch.manual_seed(seed); Transformer(cfg)`'s, and whether the global generator ended in
the same state as after the eager init.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `training`

from training.config import RunSpec
from training.initial_weights import canonical_name, initial_weights
from training.model import Transformer, cross_entropy_loss
from training.parallel import parallelize
from training.parallel.dims import ParallelDims
from training.pretrained import hf_name, tensor_files

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # bounds a mismatched collective well inside the test's timeout


def main() -> None:
    spec = RunSpec.from_json(Path(sys.argv[1]).read_text())
    out_dir = Path(sys.argv[2])
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    dims = ParallelDims.from_layout(spec.layout, world_size)
    model = parallelize(initial_weights(spec), spec, dims, dims.build_mesh("cpu"), rank, cross_entropy_loss)
    after_materialize = torch.rand(8)
    torch.manual_seed(spec.train.seed)
    eager = dict(Transformer(spec.model).named_parameters())
    after_eager = torch.rand(8)
    if spec.data.pretrained:
        stored: dict[str, torch.Tensor] = {}
        for file in set(tensor_files(Path(spec.data.pretrained)).values()):
            stored.update(load_file(str(file)))
        eager = {name: stored[hf_name(name)] for name in eager}
    held, differ = [], []
    for part in model.parts:
        for name, param in part.named_parameters():
            name = canonical_name(name)
            full = param.full_tensor() if isinstance(param, DTensor) else param  # collective: every rank, same order
            held.append(name)
            if not torch.equal(full.detach(), eager[name].detach()):
                differ.append(name)
    report = {"held": held, "differ": differ, "generator_in_step": torch.equal(after_materialize, after_eager)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # As training.train.shutdown: gloo's threads freeing tensors during the interpreter's teardown
    # abort the process now and then; the report is written.
    sys.stdout.flush()
    os._exit(0)
