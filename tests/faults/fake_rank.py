"""A stand-in rank for agent tests: gloo all-reduce steps, hooks, events and atomic checkpoints.

It follows the trainer's contracts (hooks, events file, committed checkpoints) with a model of one
number per rank, so the agent's tests run in seconds. The integration tests use the real trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from training.config import RunSpec
from training.hooks import build_hooks

STEP_SECONDS = float(os.environ.get("FAKE_RANK_STEP_SECONDS", "0.05"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--run-dir", type=Path, required=True)
    args = parser.parse_args()
    spec = RunSpec.from_json(args.spec.read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    hooks = build_hooks(spec, rank, world)
    events = Path(os.environ.get("FATHOM_EVENTS_FILE", args.run_dir / "events.jsonl"))
    checkpoints = args.run_dir / "checkpoints"

    def event(kind: str, **data: object) -> None:
        if rank == 0:
            with open(events, "a") as f:
                f.write(json.dumps({"kind": kind, "time": time.time(), **data}) + "\n")

    committed = sorted(p for p in checkpoints.glob("step_*") if (p / "COMMITTED").exists())
    w, start = 1.0, 0
    if committed:
        state = json.loads((committed[-1] / "state.json").read_text())
        w, start = state["w"], state["step"]
        event("resumed", step=start)
    for step in range(start + 1, spec.train.steps + 1):
        for h in hooks:
            h.on_step_start(step)
        grad = torch.tensor([w * (rank + 1) * 0.01])
        dist.all_reduce(grad)  # every rank must be there: a dead peer fails this step
        w = w - grad.item() / world
        time.sleep(STEP_SECONDS)
        metrics = {"step": step, "loss": w * w} if rank == 0 else {}
        for h in hooks:
            h.on_step_end(step, metrics)
        event("metrics", **metrics)
        if step % spec.train.checkpoint_interval == 0 or step == spec.train.steps:
            staging = checkpoints / f".staging_{step:08d}"
            final = checkpoints / f"step_{step:08d}"
            dist.barrier()
            if rank == 0:
                staging.mkdir(parents=True, exist_ok=True)
                (staging / "state.json").write_text(json.dumps({"w": w, "step": step}))
            dist.barrier()
            for h in hooks:
                h.before_checkpoint_commit(step, staging)
            dist.barrier()
            if rank == 0:
                os.replace(staging, final)
                (final / "COMMITTED").touch()
                event("checkpoint", step=step, path=str(final))
    event("finished", step=spec.train.steps)
    for h in hooks:
        h.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
