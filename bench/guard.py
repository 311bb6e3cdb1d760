"""What the guard costs a normal step, and what skipping non-finite steps and rolling back a
loss spike do to a run.

    python -m bench.guard [--recipe tiny] [--steps 50] [--blocks 6] [--run-steps 200]

Both in this process, one thread, the trainer the ranks run (`training.trainer.Trainer`):

1. Overhead: the recipe as a user submits it (`tiny` by default: its ~44 ms step is where a fixed
   cost per step weighs most; `small`'s takes seconds on one thread here), one trainer with
   `guard.nonfinite: skip` (the default) and one with `off`, each trained `steps` steps in
   `blocks` alternating blocks, so load that drifts over the minutes falls on both alike, and one
   with the guard off (`nonfinite: off`, `spike_zscore: 0`). The guard's cost is its finiteness
   test of the loss and the gradient norm, one read of them from the device (one process: no
   all-reduce for its verdict to ride) and the spike's z-score over the trailing window.
   `guard_step_overhead` is the median step time with it ÷ without, minus one. Target (issue
   39): ≤ 0.01.
2. A troubled run: the `tiny` recipe trained `run_steps` steps twice by `Trainer.fit` from the
   same seed and the same batches, once clean and once with five `nonfinite_grad` faults (steps
   spread over the run) and one `corrupt_weights` at three quarters of it (the weights ×8: the
   loss spikes). `nonfinite_skipped` counts what the guard skipped, `rolled_back` its rollbacks;
   `final_loss_over_clean` compares the mean loss of the last 10 steps. Target: skipped = 5,
   rolled back = 1, ratio ≤ 1.01.

Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.train_throughput import bench_spec, prepare
from training.config import FaultSpec, GuardConfig
from training.faults import FaultHook
from training.hooks import TrainHook
from training.run_dir import RunDir
from training.trainer import Trainer

FAULT_STEPS = 5


def step_times(trainer: Trainer, first: int, steps: int) -> list[float]:
    times = []
    for step in range(first, first + steps):
        start = time.perf_counter()
        trainer.train_step(step)
        times.append(time.perf_counter() - start)
    return times


def overhead(work: Path, recipe: str, steps: int, blocks: int) -> tuple[float, float, float]:
    """(median step with the guard, without, the ratio minus one)."""
    spec = bench_spec(steps=steps * blocks + 2, recipe=recipe)
    data = prepare(work, spec)
    trainers = {
        mode: Trainer(spec=dataclasses.replace(spec, guard=guard), run_dir=work / mode, data=data)
        for mode, guard in (("skip", GuardConfig()), ("off", GuardConfig(nonfinite="off", spike_zscore=0)))
    }
    for trainer in trainers.values():  # warm-up: the first steps allocate
        step_times(trainer, 1, 2)
    times: dict[str, list[float]] = {"skip": [], "off": []}
    for block in range(blocks):
        order = ("skip", "off") if block % 2 == 0 else ("off", "skip")
        for mode in order:
            times[mode] += step_times(trainers[mode], 3 + block * steps, steps)
    with_guard, without = statistics.median(times["skip"]), statistics.median(times["off"])
    return with_guard, without, with_guard / without - 1


class LossesByStep:
    """TrainHook that keeps rank 0's last reported loss of each step (a replayed step's replaces it)."""

    def __init__(self) -> None:
        self.losses: dict[int, float] = {}

    def on_step_start(self, step: int, params: list[Any]) -> None:
        pass

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        if metrics:
            self.losses[step] = metrics["loss"]

    def after_backward(self, step: int, params: list[Any]) -> None:
        pass

    def before_checkpoint_commit(self, step: int, staging_dir: Path | str) -> None:
        pass

    def close(self) -> None:
        pass


def troubled_run(work: Path, run_steps: int) -> tuple[int, int, float]:
    """(steps the guard skipped, its rollbacks, final loss ÷ the clean run's)."""
    spec = bench_spec(steps=run_steps, recipe="tiny")
    data = prepare(work, spec)
    spread = [run_steps * (i + 1) // (FAULT_STEPS + 1) for i in range(FAULT_STEPS)]
    faults = [FaultSpec(kind="nonfinite_grad", rank=0, step=step) for step in spread]
    faults.append(FaultSpec(kind="corrupt_weights", rank=0, step=run_steps * 3 // 4))
    finals = []
    for name, run_spec in (("clean", spec), ("troubled", dataclasses.replace(spec, faults=faults))):
        run_dir = work / f"run-{name}"
        losses = LossesByStep()
        hooks: list[TrainHook] = [losses]
        if run_spec.faults:
            hooks.append(FaultHook(faults, rank=0, local_rank=0, node_rank=0, run_dir=RunDir(run_dir)))
        trainer = Trainer(spec=run_spec, run_dir=run_dir, data=data, hooks=hooks)
        trainer.fit()
        finals.append(statistics.mean(losses.losses[step] for step in range(run_steps - 9, run_steps + 1)))
        print(
            f"{name}: mean loss of the last 10 steps {finals[-1]:.4f}; skipped {trainer.nonfinite_skipped}, "
            f"rolled back {trainer.guard.rollbacks}",
            flush=True,
        )
    return trainer.nonfinite_skipped, trainer.guard.rollbacks, finals[1] / finals[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=50, help="steps per block of the overhead measure")
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--run-steps", type=int, default=200, help="more than guard.window (100), so spikes are judged")
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="fathom-bench-guard-"))
    with_guard, without, cost = overhead(work, args.recipe, args.steps, args.blocks)
    print(f"step with the guard {1000 * with_guard:.1f} ms, without {1000 * without:.1f} ms", flush=True)
    skipped, rolled_back, ratio = troubled_run(work, args.run_steps)
    print(
        f"guard_step_overhead={cost:.4f} nonfinite_skipped={skipped} rolled_back={rolled_back} "
        f"final_loss_over_clean={ratio:.4f}"
    )


if __name__ == "__main__":
    main()
