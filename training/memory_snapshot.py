"""In-memory snapshots: what a restarted rank resumes from when its host survived the failure.

A disk checkpoint costs the training loop C seconds (DCP's planning, serialisation and writes
share the host's cores with training), and Young's rule puts the least total loss at
√(2·C/M) of the run for a failure every M seconds: with C ≈ 0.2 s and a crash a minute, about 8%
whatever the interval. Most failures are a rank's process dying (a crash, an OOM kill, a hang
the watchdog kills) on a host that lives on, so each rank also copies its own shard of the
state (parameters, optimizer state, data position, RNG) into shared memory, which outlives the
process: a copy into buffers kept from one snapshot to the next (and from one attempt to the
next: an earlier attempt's files are written over in place), 3-5 ms for the `tiny` model once a
slot's pages are in memory and 25 ms for `small`, no collective and no file system. The disk
checkpoints remain for what shared memory does not survive (a lost host) and for export.

Two slots per rank, written alternately: a slot's description is removed before its buffers
are overwritten and written (atomically) after, so a rank killed mid-copy leaves the other slot
whole. The ranks snapshot on the same steps; at resume they agree on the newest step every rank
holds (one all-reduce), so a rank killed during a snapshot costs one interval, not the run.
Snapshots are taken and read only by the same layout on the same world; a resized world resumes
from disk.

On a GPU the slot's buffer is registered with CUDA as pinned memory (`cudaHostRegister`), so the
device-to-host copies are DMA transfers queued on the step's stream: the training thread goes on
at once, and the kernels after them (the next step's) wait for them in stream order, so they
copy this step's state. The slot's description is written once an event recorded after the
copies has passed (`settle`, polled every step), so a snapshot counts only when it is whole.

Besides the periodic snapshots, a rank whose collective fails (a peer died, or the agent killed
a hung one) copies the state it still holds, that of the last step every rank finished, before
it exits: just-in-time checkpointing (Gupta et al., EuroSys 2024). Where the state is replicated
over dp, a rank that died reads that snapshot from a replica on the same host (`replicas`), so
the restart loses at most the step that was under way instead of half a snapshot interval.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from training.run_dir import RunDir

SLOTS = 2


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass(frozen=True)
class _TensorEntry:
    """Where one tensor of the state lies in a slot's buffer, and what it was."""

    key: tuple[int, int, str]  # (part, parameter index in the part, "param" or an optimizer state key)
    offset: int  # bytes
    shape: tuple[int, ...]
    dtype: torch.dtype
    distributed: bool  # a DTensor: restored with its parameter's mesh and placements


class MemorySnapshots:
    """One rank's snapshots of `parts` and `optimizers` in `directory` (shared memory)."""

    def __init__(
        self,
        folder: RunDir,
        *,
        rank: int,
        identity: dict[str, Any],
        parts: list[torch.nn.Module],
        optimizers: list[torch.optim.Optimizer],
        replicas: list[int] | None = None,
    ) -> None:
        self.folder = folder
        self.directory = folder.memory_snapshot_dir
        self.rank = rank
        # Ranks holding the same state as this one (this one first): a snapshot of any of them on
        # this host restores this rank.
        self.replicas = [rank, *(r for r in replicas or [] if r != rank)]
        self.identity = identity  # layout and world size: a snapshot is read back only under the same
        self.parts = parts
        self.optimizers = optimizers
        self._buffers: dict[int, np.memmap] = {}
        self._pinned: set[int] = set()  # slots whose buffer CUDA has registered as pinned
        self._next_slot = 0
        # A snapshot whose copies from the GPU are queued: (the event after them, slot, its description).
        self._pending: tuple[torch.cuda.Event, int, dict[str, Any]] | None = None

    # --- files ---------------------------------------------------------------------------------

    def _data_file(self, slot: int) -> Path:
        return self.folder.memory_snapshot_data(self.rank, slot)

    def _read_meta(self, slot: int, rank: int | None = None) -> dict[str, Any] | None:
        for path in self.folder.memory_snapshot_metas(self.rank if rank is None else rank, slot):
            try:
                with path.open("rb") as f:
                    meta: dict[str, Any] = pickle.load(f)
            except (OSError, pickle.UnpicklingError, EOFError):
                return None
            return meta if meta.get("identity") == self.identity else None
        return None

    # --- what a snapshot holds -----------------------------------------------------------------

    def _tensors(self) -> list[tuple[tuple[int, int, str], torch.Tensor]]:
        """Every tensor of this rank's state, in one fixed order. A frozen parameter (a LoRA run's
        base) is not state: training never changes it, and every start reads it again."""
        out: list[tuple[tuple[int, int, str], torch.Tensor]] = []
        for p_index, (part, opt) in enumerate(zip(self.parts, self.optimizers, strict=True)):
            for i, param in enumerate(part.parameters()):
                if not param.requires_grad:
                    continue
                out.append(((p_index, i, "param"), param.detach()))
                for key, value in sorted(opt.state.get(param, {}).items()):
                    if isinstance(value, torch.Tensor):
                        out.append(((p_index, i, key), value))
        return out

    def _buffer(self, slot: int, size: int, pin: bool) -> np.memmap:
        held = self._buffers.get(slot)
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self._data_file(slot)
        if held is None or held.size < size or not path.exists():
            self._unpin(slot)
            # An earlier attempt's file of this slot is written over in place: its pages are in
            # memory already, where a new file's are faulted in by the first copy (3× the copy).
            # Its description was removed before this call, so nothing reads the old bytes.
            reuse = path.exists() and path.stat().st_size >= size
            held = np.memmap(path, dtype=np.uint8, mode="r+" if reuse else "w+", shape=(max(size, 1),))
            self._buffers[slot] = held
        if pin and slot not in self._pinned:
            # 0: cudaHostRegisterDefault. A refusal (a driver that will not pin shared memory)
            # leaves the copies synchronous, as on a CPU, not failing.
            if torch.cuda.cudart().cudaHostRegister(held.ctypes.data, held.nbytes, 0) == 0:
                self._pinned.add(slot)
        return held

    def _unpin(self, slot: int) -> None:
        if slot in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._buffers[slot].ctypes.data)
            self._pinned.discard(slot)

    # --- taking and reading --------------------------------------------------------------------

    def take(self, step: int, extra: dict[str, Any]) -> None:
        """Copies the state after optimizer step `step`, with `extra` (data position, RNG), into the
        older slot; on a GPU the copies are queued and the snapshot counts once `settle` sees them done."""
        self.settle()
        tensors = self._tensors()
        entries: list[_TensorEntry] = []
        offset = 0
        for key, tensor in tensors:
            local = _local(tensor)
            entries.append(_TensorEntry(key, offset, tuple(local.shape), local.dtype, isinstance(tensor, DTensor)))
            offset += local.numel() * local.element_size()
            offset += -offset % 64  # aligned, so each view is a plain typed array
        slot = self._next_slot
        for old in self.folder.memory_snapshot_metas(self.rank, slot):
            old.unlink(missing_ok=True)  # from here on this slot is not a snapshot
        on_gpu = any(_local(tensor).is_cuda for _, tensor in tensors)
        buffer = self._buffer(slot, offset, pin=on_gpu)
        whole = torch.from_numpy(buffer)
        queued = slot in self._pinned
        for entry, (_, tensor) in zip(entries, tensors, strict=True):
            local = _local(tensor)
            nbytes = local.numel() * local.element_size()
            view = whole[entry.offset : entry.offset + nbytes].view(entry.dtype).view(entry.shape)
            view.copy_(local.detach(), non_blocking=queued)
        meta = {"step": step, "identity": self.identity, "entries": entries, "extra": extra}
        self._next_slot = (slot + 1) % SLOTS
        if queued:
            copied = torch.cuda.Event()
            copied.record()
            self._pending = (copied, slot, meta)
        else:
            self._describe(slot, meta)

    def settle(self, wait: bool = True) -> None:
        """Describes the snapshot whose copies were queued, once they are done (waiting for them
        unless `wait` is False: the trainer's poll after each step)."""
        if self._pending is None:
            return
        copied, slot, meta = self._pending
        if not wait and not copied.query():
            return
        copied.synchronize()
        self._pending = None
        self._describe(slot, meta)

    def _describe(self, slot: int, meta: dict[str, Any]) -> None:
        """From here on the slot is the snapshot of `meta`'s step (written atomically)."""
        final = self.folder.memory_snapshot_meta(self.rank, slot, meta["step"])
        tmp = final.with_suffix(".tmp")
        with tmp.open("wb") as f:
            pickle.dump(meta, f)
        os.replace(tmp, final)

    def steps(self) -> list[int]:
        """The steps this rank holds a whole snapshot of."""
        self.settle()
        return sorted(meta["step"] for slot in range(SLOTS) if (meta := self._read_meta(slot)) is not None)

    def discard_newer_than(self, step: int) -> None:
        """Stops counting this rank's snapshots after `step` (a guard's rollback abandoned them);
        their slots are written over first."""
        self.settle()
        for slot in range(SLOTS):
            meta = self._read_meta(slot)
            if meta is not None and meta["step"] > step:
                for path in self.folder.memory_snapshot_metas(self.rank, slot):
                    path.unlink(missing_ok=True)
                self._next_slot = slot

    def available(self) -> dict[int, int]:
        """step → the rank whose whole snapshot of it this rank can restore: its own, else a
        replica's on this host."""
        self.settle()
        found: dict[int, int] = {}
        for rank in reversed(self.replicas):  # this rank's own last, so they win
            for slot in range(SLOTS):
                meta = self._read_meta(slot, rank)
                if meta is not None:
                    found[meta["step"]] = rank
        return found

    def restore(self, step: int, source: int | None = None) -> dict[str, Any]:
        """Puts the snapshot of `step` (this rank's, or replica `source`'s) back into the parameters
        and optimizers; returns its `extra`."""
        source = self.rank if source is None else source
        slot, meta = next(
            (s, m) for s in range(SLOTS) if (m := self._read_meta(s, source)) is not None and m["step"] == step
        )
        buffer = np.memmap(self.folder.memory_snapshot_data(source, slot), dtype=np.uint8, mode="r")
        whole = torch.from_numpy(np.asarray(buffer))
        params = {
            (p_index, i): param for p_index, part in enumerate(self.parts) for i, param in enumerate(part.parameters())
        }
        with torch.no_grad():
            for entry in meta["entries"]:
                part_index, i, name = entry.key
                param = params[(part_index, i)]
                nbytes = int(np.prod(entry.shape, dtype=np.int64)) * torch.empty((), dtype=entry.dtype).element_size()
                saved = whole[entry.offset : entry.offset + nbytes].view(entry.dtype).view(entry.shape)
                if name == "param":
                    _local(param).copy_(saved)
                    continue
                value = saved.clone().to(_local(param).device if saved.dim() else saved.device)
                if entry.distributed and isinstance(param, DTensor):
                    value = DTensor.from_local(
                        value,
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
                self.optimizers[part_index].state[param][name] = value
        if source == self.rank:
            self._next_slot = (slot + 1) % SLOTS  # the next snapshot keeps this one
        else:  # the next snapshot writes over this rank's older snapshot, or an empty slot
            held = {s: m["step"] if (m := self._read_meta(s)) is not None else -1 for s in range(SLOTS)}
            self._next_slot = min(held, key=held.__getitem__)
        extra: dict[str, Any] = meta["extra"]
        return extra

    def close(self) -> None:
        self.settle()
        for slot in list(self._pinned):
            self._unpin(slot)
        self._buffers.clear()
