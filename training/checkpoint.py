"""Checkpoints that are either whole or ignored, and resume onto any layout.

Where a checkpoint lives and what it holds is the run folder contract's (`training.run_dir`:
`RunDir.checkpoint(step)`, `CheckpointDir`): DCP shards of model and optimizer (sharded,
layout-independent), each rank's RNG states, the trainer state with the layout it was written
with, and the spec and tokenizer that export needs, so a checkpoint stands alone.

A save writes everything into the `.tmp` sibling, fsyncs it, renames it to its final name (atomic
within one file system) and then writes and fsyncs the COMMITTED marker and the parent directory.
A crash at any point leaves the previous committed checkpoint as the newest one.

When the run's `data.storage` names object storage (`s3://…`), the same files go there through
fsspec (DCP's FsspecWriter/FsspecReader): written in place under their final prefix, the marker
last, as `training.checkpoint_storage` describes; async saves stay async.

Model and optimizer go through DCP's `get_state_dict`-family calls, which name every tensor by
its fully qualified parameter name whatever the sharding (FSDP, TP, pipeline stage), with the
optimizer state flattened to `state.<fqn>.<key>`. Loading under another layout therefore reads
the slices each rank now owns (resharding), and pipeline stages together hold every name once.

A LoRA run's checkpoint holds its adapters only (the frozen base is a pretrained folder's, which
every start reads again): its metadata names that folder as `lora_base`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import os
import random
import shutil
import threading
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from training.checkpoint_storage import StoredCheckpoints, checkpoints_of
from training.config import RunSpec
from training.data import TOKENIZER_FILES, copy_tokenizer
from training.hooks import TrainHook
from training.model import Transformer
from training.run_dir import (
    CHECKPOINT_METADATA,
    CHECKPOINT_SPEC,
    CHECKPOINT_TOKENIZER,
    CheckpointDir,
    RunDir,
    rng_name,
    step_of,
)

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def remove_uncommitted(run_dir: Path) -> list[Path]:
    """Deletes staging folders and folders renamed but never marked; returns what it removed."""
    folder = RunDir(run_dir)
    root = folder.checkpoints_dir
    if not root.is_dir():
        return []
    keep = set(folder.committed_checkpoints())
    removed = [p for p in root.iterdir() if p.is_dir() and p not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_metadata(checkpoint: Path) -> dict[str, Any]:
    return json.loads(CheckpointDir(checkpoint).metadata_file.read_text())


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


@functools.cache
def stager_is_reusable() -> bool:
    """Whether one DefaultStager can stage save after save. torch 2.11.0's clears its copy table
    after each save and fails the next with `KeyError: <class 'type'>` (pytorch/pytorch#183413,
    fixed by 2.13), which GPU hosts on 2.11 would meet at a run's second background save: there,
    each save gets a stager of its own (its buffers are not kept from one save to the next)."""
    probe = DefaultStager(StagingOptions(False, False, False, False))
    try:
        probe.stage({"probe": torch.zeros(1)})
        probe.stage({"probe": torch.zeros(1)})
    except KeyError:
        return False
    finally:
        probe.close()
    return True


# --- RNG ------------------------------------------------------------------------------------


def rng_state() -> dict[str, Any]:
    """Every generator a rank draws from. On a GPU, dropout and `torch.rand` on the device draw
    from the device's own generator, which the CPU one does not cover: without it a resumed run
    draws other numbers than the uninterrupted one."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the rank's own GPU (`device.activate`)
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --- Saving and loading ---------------------------------------------------------------------


@dataclass
class _PendingSave:
    """A background save: staged (the state is copied), then written, then committed."""

    step: int
    staged: Future[None]  # until then the optimizer must not step: the copy is being taken
    finished: Future[None]  # this rank's share is on disk; on rank 0, the checkpoint is committed


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
        # Rank 0, right after each commit: on the caller's thread, or a background save's own
        # thread, so the report cannot be lost to a failure between the commit and the next poll.
        on_commit: Callable[[int, str], None] | None = None,
        # The run's `data.storage`: empty, the run folder; a file:// URL, a folder of the same
        # layout; object storage, `StoredCheckpoints` there.
        storage: str = "",
    ) -> None:
        where = checkpoints_of(Path(run_dir), storage)
        self.stored = where if isinstance(where, StoredCheckpoints) else None
        # Where local checkpoints go: the run folder's, or the same names under a file:// storage root.
        self.run_dir = where if isinstance(where, RunDir) else RunDir(run_dir)
        self.parts = parts
        self.optimizers = optimizers
        self.spec = spec
        self.tokenizer_dir = tokenizer_dir
        self.rank = rank
        self.hooks = hooks
        self.on_commit = on_commit
        self.distributed = dist.is_available() and dist.is_initialized()
        self.pending: _PendingSave | None = None
        # What a rank told to stop waits for: the lock is held while a synchronous save writes and
        # commits; the future is the newest background save's (kept after `pending` is cleared).
        self._writing = threading.Lock()
        self._background_write: Future[None] | None = None
        self.async_group: dist.ProcessGroup | None = None
        if spec.train.async_checkpoint:
            # dcp.async_save's collectives run on a background thread; sharing the default group
            # with FSDP's collectives on the main thread hangs or corrupts messages.
            self.async_group = dist.new_group(backend="gloo") if self.distributed else None
            # One stager for the run: it keeps its copy buffers from one save to the next, and
            # copies on its own thread while the next step's forward and backward run (they read
            # the parameters; only the optimizer step, which waits for the copy, writes them).
            on_gpu = any(p.is_cuda for part in parts for p in part.parameters())
            self._staging_options = StagingOptions(
                use_pinned_memory=on_gpu,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=on_gpu,
            )
            self._stager: DefaultStager | None = DefaultStager(self._staging_options)
            # Waiting for the write, the hooks and (rank 0) the commit's fsyncs and renames all
            # happen here, off the training thread.
            self._finisher: ThreadPoolExecutor | None = ThreadPoolExecutor(1, thread_name_prefix="fathom-checkpoint")
        else:
            self._stager = None
            self._finisher = None

    def _state_dict(self) -> dict[str, Any]:
        model: dict[str, Any] = {}
        optim: dict[str, Any] = {}
        # A LoRA run keeps only what trains; the frozen base comes from its pretrained folder.
        options = StateDictOptions(ignore_frozen_params=self.spec.lora.enabled)
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            state = get_model_state_dict(part, options=options)
            for name in part.tied_names() if isinstance(part, Transformer) else ():
                state.pop(name, None)  # the embedding's tensor, already saved under its own name
            model.update(state)
            optim.update(get_optimizer_state_dict(part, opt, options=_OPTIM_OPTIONS))
        return {"model": model, "optim": optim}

    def _barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    # Saving ----------------------------------------------------------------------------------

    def save(self, step: int, trainer_state: dict[str, Any]) -> None:
        """Writes the checkpoint of `step`; with async_checkpoint the write finishes in the background
        (call `wait_for_staging` before the next optimizer step, and `poll` once per step)."""
        self.wait()  # at most one save in flight: a second would race the first's commit
        staging = self._staging(step)
        if self._stager is not None:
            # No barrier: resume() removed every uncommitted folder before any rank trained, so
            # nobody else is deleting this one.
            self._save_in_background(step, staging, trainer_state)
            return
        with self._writing:
            self._save_now(step, staging, trainer_state)

    def _save_now(self, step: int, staging: Path | str, trainer_state: dict[str, Any]) -> None:
        if self.rank == 0:
            self._clear(step, staging)
        self._barrier()  # nobody writes into the folder while rank 0 may still be deleting it
        self._write_rng(step, staging)
        with _single_process_quiet():
            dcp.save(self._state_dict(), no_dist=not self.distributed, **self._writer(staging))
        for hook in self.hooks:
            hook.before_checkpoint_commit(step, staging)
        self._barrier()  # every rank's shards and RNG file are written
        if self.rank == 0:
            self._commit(step, staging, trainer_state)
            if self.on_commit is not None:
                self.on_commit(step, self.location(step))
        # No rank steps past a checkpoint before it is committed: a rank that fails right after
        # it then resumes from it, instead of from the one before.
        self._barrier()

    def location(self, step: int) -> str:
        """Where the committed checkpoint of `step` is: a folder, or a URL on object storage."""
        if self.stored is not None:
            return self.stored.url_of(step)
        return str(self.run_dir.checkpoint(step))

    def _staging(self, step: int) -> Path | str:
        """Where the checkpoint of `step` is written: the `.tmp` folder, or (object storage, which
        cannot rename) its final prefix, which counts only once its marker is written."""
        if self.stored is not None:
            return self.stored.url_of(step)
        return self.run_dir.checkpoint_staging(step)

    def _writer(self, staging: Path | str) -> dict[str, Any]:
        if isinstance(staging, Path):
            return {"checkpoint_id": staging}
        # torch exposes FsspecWriter/Reader only from a private module (torchtitan imports them so too).
        # sync_files: an object is durable once its PUT returns; fsync does not apply to it.
        return {"storage_writer": FsspecWriter(staging, sync_files=False)}

    def _clear(self, step: int, staging: Path | str) -> None:
        """Rank 0, before a synchronous save: removes what a crashed attempt left under the same name."""
        if self.stored is not None:
            self.stored.remove(step)
        elif isinstance(staging, Path) and staging.exists():
            shutil.rmtree(staging)

    def _write_rng(self, step: int, staging: Path | str) -> None:
        if self.stored is not None:
            buffer = io.BytesIO()
            torch.save(rng_state(), buffer)
            self.stored.fs.pipe_file(self.stored.path_of(step, rng_name(self.rank)), buffer.getvalue())
            return
        assert isinstance(staging, Path)
        rng_file = CheckpointDir(staging).rng_file(self.rank)
        rng_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(), rng_file)

    def _save_in_background(self, step: int, staging: Path | str, trainer_state: dict[str, Any]) -> None:
        assert self._stager is not None and self._finisher is not None
        self._write_rng(step, staging)  # now: the RNG moves on with the next step
        stager = self._stager if stager_is_reusable() else DefaultStager(self._staging_options)
        response = dcp.async_save(
            self._state_dict(), process_group=self.async_group, async_stager=stager, **self._writer(staging)
        )
        assert isinstance(response, AsyncSaveResponse)

        def finish() -> None:
            try:
                response.upload_completion.result()  # re-raises a failed write
            finally:
                if stager is not self._stager:
                    stager.close()
            # Each rank calls the hook once its own write is done, which for ranks other than 0
            # may be after rank 0 committed; with synchronous saves every rank calls it first.
            for hook in self.hooks:
                hook.before_checkpoint_commit(step, staging)
            # Rank 0's write completes only after DCP gathered every rank's write results and
            # wrote the metadata, and each rank wrote its RNG file before joining that save, so
            # rank 0 may commit without a barrier (which saves finishing at different steps on
            # different ranks could not meet).
            if self.rank == 0:
                self._commit(step, staging, trainer_state)
                if self.on_commit is not None:
                    self.on_commit(step, self.location(step))

        self._background_write = self._finisher.submit(finish)
        self.pending = _PendingSave(step, response.staging_completion, self._background_write)

    def wait_for_staging(self) -> None:
        """Blocks until a background save has copied the state; call before each optimizer step."""
        if self.pending is not None:
            self.pending.staged.result()

    def poll(self) -> None:
        """Reports a finished background save (and re-raises its failure); call once per step."""
        if self.pending is not None and self.pending.finished.done():
            self._finish_pending()

    def wait(self) -> None:
        """Blocks until a background save is written and committed."""
        if self.pending is not None:
            self._finish_pending()

    def finish_writing(self) -> None:
        """Blocks until no save is being written: one under way, synchronous or in the background,
        is committed first (or has failed). Safe from another thread while the rank trains on; a
        save started after the call is not waited for."""
        with self._writing:
            background = self._background_write
        if background is not None:
            with contextlib.suppress(BaseException):  # its failure is the training thread's to report
                background.result()

    def close(self) -> None:
        """Waits for a background save, then stops the background threads."""
        self.wait()
        if self._finisher is not None:
            self._finisher.shutdown()
        if self._stager is not None:
            self._stager.close()

    def _finish_pending(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        pending.staged.result()
        pending.finished.result()

    def _commit(self, step: int, staging: Path | str, trainer_state: dict[str, Any]) -> None:
        metadata = {
            **trainer_state,
            "step": step,
            "layout": dataclasses.asdict(self.spec.layout),
            "world_size": dist.get_world_size() if self.distributed else 1,
            **({"lora_base": self.spec.data.pretrained} if self.spec.lora.enabled else {}),
        }
        metadata_text = json.dumps(metadata, indent=2, sort_keys=True) + "\n"
        if self.stored is not None:
            self._commit_stored(step, metadata_text)
            return
        assert isinstance(staging, Path)
        written = CheckpointDir(staging)
        written.metadata_file.write_text(metadata_text)
        written.spec_file.write_text(self.spec.to_json() + "\n")
        copy_tokenizer(self.tokenizer_dir, written.tokenizer_dir)
        _fsync_tree(staging)
        final = self.run_dir.checkpoint(step)
        if final.exists():  # a torn folder of the same step from a crashed attempt
            shutil.rmtree(final)
        os.rename(staging, final)
        _write_durably(CheckpointDir(final).committed_marker, f"{step}\n")
        _fsync_dir(final.parent)
        for old in self.committed_steps()[: -self.spec.train.keep_checkpoints]:
            self._remove(old)

    def _commit_stored(self, step: int, metadata_text: str) -> None:
        """Every rank's shards and RNG file and DCP's metadata are written: add rank 0's files,
        then the marker that makes the checkpoint count, then prune."""
        stored = self.stored
        assert stored is not None
        stored.fs.pipe_file(stored.path_of(step, CHECKPOINT_METADATA), metadata_text.encode())
        stored.fs.pipe_file(stored.path_of(step, CHECKPOINT_SPEC), (self.spec.to_json() + "\n").encode())
        for name in TOKENIZER_FILES:
            stored.fs.put_file(str(self.tokenizer_dir / name), stored.path_of(step, CHECKPOINT_TOKENIZER, name))
        stored.commit(step)
        for old in stored.committed_steps()[: -self.spec.train.keep_checkpoints]:
            self._remove(old)

    # Which checkpoints there are ----------------------------------------------------------------

    def committed_steps(self) -> list[int]:
        """The steps of the committed checkpoints, oldest first."""
        if self.stored is not None:
            return self.stored.committed_steps()
        return [int(step_of(path) or 0) for path in self.run_dir.committed_checkpoints()]

    def latest_step(self, before: int | None = None) -> int | None:
        """The step of the newest committed checkpoint (before step `before`, if given), if any."""
        steps = [step for step in self.committed_steps() if before is None or step < before]
        return steps[-1] if steps else None

    def remove_newer_than(self, step: int) -> None:
        """Deletes the committed checkpoints after `step`: a guard's rollback abandoned them (rank 0)."""
        for newer in (s for s in self.committed_steps() if s > step):
            self._remove(newer)

    def _remove(self, step: int) -> None:
        """Deletes the committed checkpoint of `step`, its marker first: what is left never counts."""
        if self.stored is not None:
            self.stored.remove(step)
            return
        path = self.run_dir.checkpoint(step)
        CheckpointDir(path).committed_marker.unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)

    def remove_uncommitted(self) -> None:
        """Deletes the torn saves of an earlier attempt; rank 0, before any rank saves."""
        if self.stored is not None:
            self.stored.remove_uncommitted()
        else:
            remove_uncommitted(self.run_dir.path)

    # Loading ---------------------------------------------------------------------------------

    def load(self, step: int) -> dict[str, Any]:
        """Restores model, optimizer and this rank's RNG from the committed checkpoint of `step`;
        returns the trainer state saved with them."""
        state = self._state_dict()
        reader: dict[str, Any] = (
            {"storage_reader": FsspecReader(self.stored.url_of(step))}
            if self.stored is not None
            else {"checkpoint_id": self.run_dir.checkpoint(step)}
        )
        with _single_process_quiet():
            dcp.load(state, no_dist=not self.distributed, **reader)
        for part, opt in zip(self.parts, self.optimizers, strict=True):
            # Each part takes its own names from the merged dicts (other stages' names are ignored).
            set_model_state_dict(part, state["model"], options=StateDictOptions(strict=False))
            set_optimizer_state_dict(part, opt, optim_state_dict=state["optim"], options=_OPTIM_OPTIONS)
        if self.stored is not None:
            return self._load_stored_extras(step)
        checkpoint = self.run_dir.checkpoint(step)
        rng_file = CheckpointDir(checkpoint).rng_file(self.rank)
        if rng_file.exists():  # absent when resuming on more ranks than saved; those keep their seed
            set_rng_state(torch.load(rng_file, weights_only=False))
        return read_metadata(checkpoint)

    def _load_stored_extras(self, step: int) -> dict[str, Any]:
        stored = self.stored
        assert stored is not None
        rng_path = stored.path_of(step, rng_name(self.rank))
        if stored.fs.exists(rng_path):  # absent when resuming on more ranks than saved
            set_rng_state(torch.load(io.BytesIO(stored.fs.cat_file(rng_path)), weights_only=False))
        metadata: dict[str, Any] = json.loads(stored.fs.cat_file(stored.path_of(step, CHECKPOINT_METADATA)))
        return metadata
