"""A run's checkpoints on object storage, where nothing can be renamed into place.

Each checkpoint is written straight under its final prefix (`step_<N>/`, names from
`training.run_dir`): every rank's DCP shards and RNG file, DCP's `.metadata`, then rank 0's
`fathom.json`, spec and tokenizer, and last the COMMITTED marker. A checkpoint counts only once
its marker exists; readers list markers and trust nothing else. A killed writer leaves a prefix
without a marker: never loaded, and deleted by `remove_uncommitted` when the run starts again
(before any rank writes). Deleting a checkpoint removes its marker first, so a half-deleted
one stops counting at once.

Torch-free: the control plane reads the same markers to tell a pruned checkpoint.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from fsspec.spec import AbstractFileSystem

from training.run_dir import COMMITTED_MARKER, RunDir, checkpoint_name, step_of, storage_checkpoints_url
from training.storage import Storage, join, local_root


class StoredCheckpoints:
    """The checkpoints folder of one run on storage (`run_dir.storage_checkpoints_url`)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.storage = Storage.open(url)

    @property
    def fs(self) -> AbstractFileSystem:
        return self.storage.fs

    def url_of(self, step: int, *parts: str) -> str:
        return join(self.url, checkpoint_name(step), *parts)

    def path_of(self, step: int, *parts: str) -> str:
        return self.storage.path(checkpoint_name(step), *parts)

    def _listed_steps(self) -> list[int]:
        """Steps with any object under their prefix, committed or not."""
        try:
            names = self.fs.ls(self.storage.root, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(s for name in names if (s := step_of(PurePosixPath(name))) is not None)

    def committed_steps(self) -> list[int]:
        """Steps whose marker exists, oldest first: the only checkpoints that count."""
        markers = self.fs.glob(self.storage.path("step_*", COMMITTED_MARKER), refresh=True)
        found = (step_of(PurePosixPath(m).parent) for m in markers)
        return sorted(s for s in found if s is not None)

    def latest_step(self) -> int | None:
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def is_committed(self, step: int) -> bool:
        return bool(self.fs.exists(self.path_of(step, COMMITTED_MARKER)))

    def remove(self, step: int) -> None:
        """Deletes a checkpoint: its marker first, so what is left of it never counts."""
        marker = self.path_of(step, COMMITTED_MARKER)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        if self.fs.exists(self.path_of(step)):
            self.fs.rm(self.path_of(step), recursive=True)
        self.fs.invalidate_cache(self.storage.root)

    def remove_uncommitted(self) -> list[int]:
        """Deletes every prefix without a marker (writes of a killed attempt); returns their steps.
        Call only while no rank writes: the node agent restarts ranks after all have stopped."""
        keep = set(self.committed_steps())
        torn = [s for s in self._listed_steps() if s not in keep]
        for step in torn:
            self.remove(step)
        return torn

    def commit(self, step: int) -> None:
        """Writes the marker; every other object of the checkpoint must already be written."""
        self.fs.pipe_file(self.path_of(step, COMMITTED_MARKER), f"{step}\n".encode())
        self.fs.invalidate_cache(self.storage.root)


def is_committed_at(checkpoint_url: str) -> bool:
    """Whether the checkpoint at `checkpoint_url` (a step's prefix, as a run reports it) still counts."""
    stored = Storage.open(checkpoint_url)
    return bool(stored.fs.exists(stored.path(COMMITTED_MARKER)))


def checkpoints_of(run_dir: Path, storage: str) -> RunDir | StoredCheckpoints:
    """Where the run in `run_dir` keeps its checkpoints, by its `data.storage`: empty, its own
    folder; a file:// URL, a folder of the same layout under that root; object storage, there."""
    if not storage:
        return RunDir(run_dir)
    root = local_root(storage)
    if root is not None:
        return RunDir(root / "runs" / run_dir.name)
    return StoredCheckpoints(storage_checkpoints_url(storage, run_dir.name))


def latest_committed_step(run_dir: Path, storage: str) -> int:
    """The step of the run's newest committed checkpoint wherever it keeps them; 0 for none."""
    where = checkpoints_of(run_dir, storage)
    if isinstance(where, RunDir):
        return where.latest_committed_step()
    return where.latest_step() or 0
