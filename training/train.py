"""Rank entry point: `torchrun … -m training.train --spec spec.json --run-dir DIR`.

Each rank computes on its GPU (`LOCAL_RANK`, NCCL) when torch sees one, else on the CPU with gloo
(training/device.py). Also runs as a single process without torchrun (world size 1). On every start
it resumes from the newest committed checkpoint in DIR, so torchrun's restarts after a crash need
nothing else.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from training.config import RunSpec
from training.data import prepare_data
from training.device import activate, device_from_environment
from training.hooks import build_hooks
from training.metrics import EventLog
from training.trainer import Trainer

# Gloo's default is 30 minutes: a rank stuck in a collective would hold the whole job that long
# with no error. Two minutes bounds that while leaving room for the slowest legitimate wait on a
# loaded CPU host (a checkpoint written by every rank, the first pipeline step's shape exchange).
# The node agent's heartbeat watchdog catches hangs sooner; this is the backstop inside the ranks.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m training.train", description=__doc__)
    parser.add_argument("--spec", type=Path, required=True, help="RunSpec JSON")
    parser.add_argument("--run-dir", type=Path, required=True, help="checkpoints, events, data cache")
    return parser.parse_args(argv)


def keep_spec(path: Path, spec_text: str) -> None:
    """Copies the spec into the run folder. Atomically, and only if it differs: the file given with
    --spec is often this very file, and the other ranks may be reading it right now."""
    if path.exists() and path.read_text() == spec_text:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(spec_text)
    tmp.replace(path)


def run(spec: RunSpec, run_dir: Path, spec_text: str) -> None:
    # torchrun's contract: RANK and WORLD_SIZE name this process; absent, it is a single process.
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != spec.layout.world_size:
        raise SystemExit(
            f"the spec's layout needs dp·tp·pp = {spec.layout.world_size} ranks; torchrun started {world_size}"
        )
    # Before the process group: tokenizing a large corpus may take longer than any collective timeout.
    data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, run_dir / "data")
    device = device_from_environment()  # CUDA + NCCL on GPU LOCAL_RANK when there is one, else CPU + gloo
    activate(device)
    if world_size > 1:
        dist.init_process_group(device.backend, timeout=COLLECTIVE_TIMEOUT)
    events = None
    if rank == 0:
        keep_spec(run_dir / "spec.json", spec_text)
        events = EventLog(Path(os.environ.get("FATHOM_EVENTS_FILE", run_dir / "events.jsonl")))
    trainer = Trainer(
        spec=spec,
        run_dir=run_dir,
        data=data,
        rank=rank,
        world_size=world_size,
        hooks=build_hooks(spec, rank, world_size),
        events=events,
        device=device,
    )
    trainer.fit()
    if events is not None:
        events.close()


def shutdown(exit_code: int) -> None:
    """Leaves without the interpreter's teardown: gloo's threads freeing tensors during it abort the
    process now and then ("terminate called without an active exception"), which torchrun would
    report as a failed job. The barrier makes sure no rank leaves while another still needs it."""
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        if exit_code == 0:
            dist.barrier()
        dist.destroy_process_group()
    os._exit(exit_code)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` prints a stuck rank's stacks
    spec_text = args.spec.read_text()
    spec = RunSpec.from_json(spec_text)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        run(spec, args.run_dir, spec_text)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # a failed rank must not wait on peers in teardown; torchrun restarts the job
    shutdown(0)


if __name__ == "__main__":
    main()
