"""The rank's default group carries both kinds of tensor a rank holds, and agreements come out the
same on every rank (training/collectives.py). Two real processes joined the way torchrun's ranks
are (env://), each on the device `device_from_environment` picks: the CPU here, its GPU on a GPU
host, where the same group is `cpu:gloo,cuda:nccl`."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.ports import free_port
from training.collectives import agreed, init_default_group
from training.device import device_from_environment


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2"
    )
    torch.set_num_threads(1)
    device = device_from_environment()
    init_default_group(device, timedelta(seconds=60))
    on_device = agreed([rank, 10 * rank], dist.ReduceOp.MAX, device=device.torch_device)
    on_cpu = agreed([rank + 1], dist.ReduceOp.MIN, device=torch.device("cpu"))
    # What the trainer reduces itself: a tensor of the step, made on the rank's device.
    loss = torch.full((), float(rank + 1), device=device.torch_device)
    dist.all_reduce(loss)
    Path(out, f"{rank}.json").write_text(json.dumps({"device": on_device, "cpu": on_cpu, "loss": loss.item()}))
    dist.destroy_process_group()
    # As training.train.shutdown: gloo's threads freeing tensors during the interpreter's
    # teardown abort the process now and then (SIGABRT, "terminate called without an active
    # exception"); everything this rank had to say is written.
    os._exit(0)


def test_one_group_carries_the_ranks_device_tensors_and_cpu_tensors_and_every_rank_agrees(tmp_path: Path) -> None:
    port = free_port()
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert results == [{"device": [1.0, 10.0], "cpu": [1.0], "loss": 3.0}] * 2
