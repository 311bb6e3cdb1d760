"""Where a run's checkpoints live and which of them count: plain file-system logic, no torch.

The node agent reads these without importing torch; `training.checkpoint` writes and loads
checkpoints under the same rules.
"""

from __future__ import annotations

from pathlib import Path

COMMITTED = "COMMITTED"
_PREFIX = "step_"


def checkpoints_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoints_root(run_dir) / f"{_PREFIX}{step:08d}"


def step_of(path: Path) -> int | None:
    """The step a checkpoint folder's name says, or None for any other name."""
    name = path.name
    if not name.startswith(_PREFIX) or not name[len(_PREFIX) :].isdigit():
        return None
    return int(name[len(_PREFIX) :])


def committed_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first."""
    root = checkpoints_root(run_dir)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p)) is not None and (p / COMMITTED).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    committed = committed_checkpoints(run_dir)
    return committed[-1] if committed else None


def latest_committed_step(run_dir: Path) -> int:
    """The step of the newest committed checkpoint, 0 when there is none."""
    latest = latest_checkpoint(run_dir)
    return 0 if latest is None else int(step_of(latest) or 0)
