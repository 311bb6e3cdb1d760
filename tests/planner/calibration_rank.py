"""One torchrun rank of the planner's calibration: runs Fathom's real Trainer on each case's spec and
writes what it held and sent.

    torchrun --standalone --nproc-per-node N tests/planner/calibration_rank.py CASES.json OUT_DIR DATA_DIR

CASES.json is a list of {"name", "spec"} whose layouts all need N ranks; each case writes
OUT_DIR/<name>.rank<R>.json. Step 1 warms up (pipeline shape exchange, FSDP's lazy init, AdamW's
state); step 2 is measured.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `training`

from rank_probe import ActivationPeak, GradTap, TrafficCounter, mesh_groups, state_bytes

from training import trainer as trainer_module
from training.config import RunSpec
from training.data import prepare_data
from training.trainer import Trainer

# Bounds a collective that never completes (a mismatched case) well inside the test's own timeout.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


def stop_after_backward(trainer: Trainer, peak: ActivationPeak) -> Callable[[], None]:
    """Ends activation tracking where the trainer's backward ends: at the gradient all-reduce's
    `finish()` (zero 0 with dp) or at clipping, whichever comes first. Returns the undo."""
    sync = trainer.model.grad_sync
    if sync is not None:
        finish = sync.finish

        def finish_then_stop() -> None:
            peak.stop()
            finish()

        sync.finish = finish_then_stop  # type: ignore[method-assign]
    clip = trainer_module.clip_grad_norm_

    def clip_then_stop(*args: Any, **kwargs: Any) -> Any:
        peak.stop()
        return clip(*args, **kwargs)

    trainer_module.clip_grad_norm_ = clip_then_stop  # type: ignore[assignment]

    def undo() -> None:
        trainer_module.clip_grad_norm_ = clip  # type: ignore[assignment]

    return undo


def collect_before_each_pass(trainer: Trainer) -> None:
    """Frees the previous pass's cyclic garbage (autograd and DTensor leave some) before each pass,
    so the measured peak does not depend on when Python's cycle collector happens to run."""
    forward_backward = trainer.forward_backward

    def collected(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        return forward_backward(*args, **kwargs)

    trainer.forward_backward = collected  # type: ignore[method-assign]


def measure(spec: RunSpec, run_dir: Path, data_dir: Path, rank: int, world: int) -> dict[str, object]:
    data = prepare_data(spec.data, spec.model.vocab_size, spec.model.seq_len, data_dir)
    trainer = Trainer(spec=spec, run_dir=run_dir, data=data, rank=rank, world_size=world)
    trainer.train_step(1)
    parts = list(trainer.model.parts)
    traffic = TrafficCounter(mesh_groups(trainer.dims, rank), world)
    activations = ActivationPeak(parts)
    grads = GradTap(trainer.optimizers, trainer.params, activations)
    undo = stop_after_backward(trainer, activations)
    collect_before_each_pass(trainer)
    with traffic, activations:
        trainer.train_step(2)
    undo()
    grads.close()
    weights, optimizer = state_bytes(trainer.params, trainer.optimizers)
    return {
        "rank": rank,
        "coords": trainer.dims.coordinates(rank),
        "weights": weights,
        "grads": grads.grad_bytes,
        "optimizer": optimizer,
        "activations": activations.peak,
        "alive_at_peak": activations.at_peak,
        "sent": dict(traffic.sent),
        "calls": dict(traffic.calls),
        "sent_by_op": dict(traffic.by_op),
        "unknown_collectives": sorted(traffic.unknown),
    }


def main() -> None:
    cases_path, out_dir, data_dir = (Path(a) for a in sys.argv[1:4])
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    code = 0
    try:
        for case in json.loads(cases_path.read_text()):
            spec = RunSpec.from_dict(case["spec"])
            with tempfile.TemporaryDirectory(prefix=f"calib-{case['name']}-") as run_dir:
                result = measure(spec, Path(run_dir), data_dir, rank, world)
            (out_dir / f"{case['name']}.rank{rank}.json").write_text(json.dumps(result))
            dist.barrier()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # As training/train.py does: skip the interpreter's teardown, where gloo threads may abort.
    if code == 0:
        dist.barrier()
    dist.destroy_process_group()
    os._exit(code)


if __name__ == "__main__":
    main()
