"""`layout.overlap_grad_reduce` decides when zero=0's gradient all-reduce is issued: bucket by
bucket during backward, or all of it after backward, in `finish()` (training/parallel/replicate.py).
Two real gloo ranks; both ways end with the same averaged gradients."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from tests.ports import free_port
from training.config import LayoutConfig, SpecError
from training.parallel.replicate import GradientAllReduce


def _rank(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    seen = {}
    for overlap in (True, False):
        torch.manual_seed(0)  # the same weights on both ranks
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(4)))
        # One bucket per layer (a layer's weight and bias are 16.6 kB): four reductions to place.
        sync = GradientAllReduce([model], dist.group.WORLD, accumulations_per_step=1, bucket_bytes=16_000, overlap=overlap)
        model(torch.full((2, 64), float(rank + 1))).sum().backward()
        issued_during_backward = sum(bucket.work is not None for bucket in sync.buckets)
        sync.finish()
        seen[str(overlap)] = {
            "buckets": len(sync.buckets),
            "issued_during_backward": issued_during_backward,
            "grad_sum": float(sum(p.grad.sum() for p in model.parameters())),
        }
    Path(out, f"{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()
    # As training.train.shutdown: gloo's threads freeing tensors during the interpreter's
    # teardown abort the process now and then (SIGABRT, "terminate called without an active
    # exception"); everything this rank had to say is written.
    os._exit(0)


def test_overlap_issues_each_buckets_all_reduce_during_backward_and_without_it_all_after(tmp_path: Path) -> None:
    port = free_port()
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank ends with the same averaged gradients
    on, off = ranks[0]["True"], ranks[0]["False"]
    assert (on["buckets"], on["issued_during_backward"]) == (4, 4)
    assert (off["buckets"], off["issued_during_backward"]) == (4, 0)
    assert on["grad_sum"] == pytest.approx(off["grad_sum"], rel=1e-6)


def test_fsdp_refuses_overlap_off_naming_the_field() -> None:
    with pytest.raises(SpecError, match=r"layout\.overlap_grad_reduce.*false applies to zero=0 only"):
        LayoutConfig(dp=2, zero=3, overlap_grad_reduce=False)
    with pytest.raises(SpecError, match=r"layout\.overlap_grad_reduce.*must be true or false; got 'no'"):
        LayoutConfig(overlap_grad_reduce="no")  # type: ignore[arg-type]
