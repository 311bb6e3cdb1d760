"""Checkpoints that are either whole or ignored, and resume onto any layout.

Layout of a run directory:

    DIR/checkpoints/step_00000025/          committed: renamed into place, then COMMITTED written
        .metadata, __0_0.distcp, …          model + optimizer, DCP (sharded, layout-independent)
        rng/rank00000.pt                    each rank's RNG states
        fathom.json                         step, sampler position, layout it was written with
        spec.json, tokenizer/               what export needs, so a checkpoint stands alone
        COMMITTED                           the marker; a folder without it never counts
    DIR/checkpoints/step_00000050.tmp/      being written (or torn by a crash): ignored, then deleted

A save writes everything into the `.tmp` sibling, fsyncs it, renames it to its final name (atomic
within one file system) and then writes and fsyncs the COMMITTED marker and the parent directory.
A crash at any point leaves the previous committed checkpoint as the newest one.

Model and optimizer go through DCP's `get_state_dict`-family calls, which name every tensor by
its fully qualified parameter name whatever the sharding (FSDP, TP, pipeline stage), with the
optimizer state flattened to `state.<fqn>.<key>`. Loading under another layout therefore reads
the slices each rank now owns (resharding), and pipeline stages together hold every name once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from training.checkpoint_paths import (
    _PREFIX,
    COMMITTED,
    checkpoint_path,
    checkpoints_root,
    committed_checkpoints,
)
from training.config import RunSpec
from training.data import copy_tokenizer
from training.hooks import TrainHook

METADATA = "fathom.json"
_STAGING_SUFFIX = ".tmp"
_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def remove_uncommitted(run_dir: Path) -> list[Path]:
    """Deletes staging folders and folders renamed but never marked; returns what it removed."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    keep = set(committed_checkpoints(run_dir))
    removed = [p for p in root.iterdir() if p.is_dir() and p not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_metadata(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / METADATA).read_text())


def _fsync_tree(path: Path) -> None:
    for file in path.rglob("*"):
        if file.is_file():
            with file.open("rb") as f:
                os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save and load that it assumes one process; that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# --- RNG ------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


# --- Saving and loading ---------------------------------------------------------------------


@dataclass
class _PendingSave:
    step: int
    staging: Path
    future: Future[Any]
    trainer_state: dict[str, Any]


class Checkpointer:
    """Saves and loads one rank's share of the model, optimizer, data position and RNG."""

    def __init__(
        self,
        *,
        run_dir: Path,
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        spec: RunSpec,
        tokenizer_dir: Path,
        rank: int,
        hooks: list[TrainHook],
        on_commit: Callable[[int, Path], None] | None = None,  # rank 0, after each commit
    ) -> None:
        self.run_dir = run_dir
        self.parts = parts
        self.optimizers = optimizers
        self.spec = spec
        self.tokenizer_dir = tokenizer_dir
        self.rank = rank
        self.hooks = hooks
        self.on_commit = on_commit
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pending: _PendingSave | None = None
        # dcp.async_save's collectives run on a background thread; sharing the default group with
        # FSDP's collectives on the main thread hangs or corrupts messages, so it gets its own group.
        self.async_group = dist.new_group(backend="gloo") if spec.train.async_checkpoint and self.distributed else None

    def _state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            model.update(get_model_state_dict(part))
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        return {"model": model, "optim": optim}

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    # Saving ----------------------------------------------------------------------------------

    def save(self, step: int, trainer_state: dict[str, Any]) -> None:
        """Writes the checkpoint of `step`; with async_checkpoint the write finishes in the background."""
        self.wait()  # at most one save in flight: a second would race the first's commit
        staging = checkpoint_path(self.run_dir, step).with_name(f"{_PREFIX}{step:08d}{_STAGING_SUFFIX}")
        if self.rank == 0 and staging.exists():
            shutil.rmtree(staging)
        self._barrier()  # nobody writes into the folder while rank 0 may still be deleting it
        (staging / "rng").mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), staging / "rng" / f"rank{self.rank:05d}.pt")
        state = self._state_dict()
        if self.async_group is not None:
            future = dcp.async_save(state, checkpoint_id=staging, process_group=self.async_group)
            assert isinstance(future, Future)
            self.pending = _PendingSave(step, staging, future, trainer_state)
            return
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=staging, no_dist=not self.distributed)
        for hook in self.hooks:
            hook.before_checkpoint_commit(step, staging)
        self._barrier()  # every rank's shards and RNG file are on disk
        if self.rank == 0:
            self._commit(step, staging, trainer_state)
        # No rank steps past a checkpoint before it is committed: a rank that fails right after
        # it then resumes from it, instead of from the one before.
        self._barrier()

    def poll(self) -> None:
        """Commits a finished background save; call once per step. Never blocks."""
        if self.pending is not None and self.pending.future.done():
            self._finish_pending()

    def wait(self) -> None:
        """Blocks until a background save is written and committed."""
        if self.pending is not None:
            self._finish_pending()

    def _finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        pending.future.result()  # re-raises a failed write
        # Each rank calls the hook once its own background write is done, which for ranks other
        # than 0 may be after rank 0 committed; with synchronous saves every rank calls it first.
        for hook in self.hooks:
            hook.before_checkpoint_commit(pending.step, pending.staging)
        # Rank 0's future completes only after DCP gathered every rank's write results and wrote
        # the metadata, and each rank wrote its RNG file before joining that save, so rank 0 may
        # commit without a barrier (which background completion at different steps could not meet).
        if self.rank == 0:
            self._commit(pending.step, pending.staging, pending.trainer_state)

    def _commit(self, step: int, staging: Path, trainer_state: dict[str, Any]) -> None:
        metadata = {
            **trainer_state,
            "step": step,
            "layout": dataclasses.asdict(self.spec.layout),
            "world_size": dist.get_world_size() if self.distributed else 1,
        }
        (staging / METADATA).write_text(json.dumps(metadata, indent=2, sort_keys=True) + "\n")
        (staging / "spec.json").write_text(self.spec.to_json() + "\n")
        copy_tokenizer(self.tokenizer_dir, staging / "tokenizer")
        _fsync_tree(staging)
        final = checkpoint_path(self.run_dir, step)
        if final.exists():  # a torn folder of the same step from a crashed attempt
            shutil.rmtree(final)
        os.rename(staging, final)
        _write_durably(final / COMMITTED, f"{step}\n")
        _fsync_dir(final.parent)
        for old in committed_checkpoints(self.run_dir)[: -self.spec.train.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        if self.on_commit is not None:
            self.on_commit(step, final)

    # Loading ---------------------------------------------------------------------------------

    def load(self, checkpoint: Path) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG; returns the trainer state saved with them."""
        state = self._state_dict()
        with _single_process_quiet():
            dcp.load(state, checkpoint_id=checkpoint, no_dist=not self.distributed)
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            # Each part takes its own names from the merged dicts (other stages' names are ignored).
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, optim_state_dict=state["optim"], options=_OPTIM_OPTIONS)
        rng_file = checkpoint / "rng" / f"rank{self.rank:05d}.pt"
        if rng_file.exists():  # absent when resuming on more ranks than saved; those keep their seed
            set_rng_state(torch.load(rng_file, weights_only=False))
        return read_metadata(checkpoint)
