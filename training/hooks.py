"""Points where the node agent's machinery plugs into the training loop without editing it.

The trainer calls every hook at fixed points of each step; hooks never change what is
computed, so a run with hooks produces the same losses as one without (an injected fault, by
design, aside: `nonfinite_grad` spoils a gradient, `corrupt_weights` the weights). The heartbeat
(watchdog) and fault injection are hooks; `build_hooks` reads what the agent asked for
from the environment it set for the rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from training.config import RunSpec


class TrainHook(Protocol):
    def on_step_start(self, step: int, params: list[Any]) -> None:
        """Called before the forward pass of optimizer step `step` (1-based), with the rank's parameters."""

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None:
        """Called after the optimizer step; `metrics` is rank 0's metrics row (empty on other ranks)."""

    def after_backward(self, step: int, params: list[Any]) -> None:
        """Called once the gradients of step `step` are whole (synced), before they are measured."""

    def before_checkpoint_commit(self, step: int, staging_dir: Path | str) -> None:
        """Called after every shard of a checkpoint is written and before it is committed."""

    def close(self) -> None:
        """Called once when training ends normally."""


def build_hooks(spec: RunSpec, rank: int, world_size: int) -> list[TrainHook]:
    """The hooks this rank runs; none unless its agent asked for them."""
    # Imported here so that importing the contract stays free of the agent's machinery.
    import os

    from training.faults import FaultHook
    from training.heartbeat import HeartbeatHook
    from training.rank_environment import RankEnvironment
    from training.run_dir import RunDir

    env = RankEnvironment.from_environ()
    if env is None:
        return []
    hooks: list[TrainHook] = [HeartbeatHook(env.heartbeat_file, rank, env.heartbeat_interval)]
    if spec.faults:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        hooks.append(
            FaultHook(
                spec.faults, rank=rank, local_rank=local_rank, node_rank=env.node_rank, run_dir=RunDir(env.run_dir)
            )
        )
    return hooks
