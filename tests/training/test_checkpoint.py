"""Checkpoints: only committed ones count, resume is exact, and a checkpoint loads onto another layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.staging import DefaultStager

from tools.check_parity import launch, parity_spec, step_values
from training import checkpoint
from training.checkpoint import read_metadata, remove_uncommitted
from training.config import DataConfig, RunSpec
from training.rank_events import METRIC_KEYS
from training.run_dir import CheckpointDir, RunDir

TIMEOUT = 600


def make_checkpoint(run_dir: Path, step: int, committed: bool = True) -> Path:
    path = RunDir(run_dir).checkpoint(step)
    path.mkdir(parents=True)
    if committed:
        CheckpointDir(path).committed_marker.write_text(f"{step}\n")
    return path


def test_the_newest_committed_checkpoint_wins_and_torn_ones_are_ignored(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    newest = make_checkpoint(tmp_path, 20)
    make_checkpoint(tmp_path, 30, committed=False)  # renamed into place, crashed before the marker
    RunDir(tmp_path).checkpoint_staging(40).mkdir()  # crashed while writing
    assert RunDir(tmp_path).latest_checkpoint() == newest
    assert [p.name for p in RunDir(tmp_path).committed_checkpoints()] == ["step_00000010", "step_00000020"]


def test_cleaning_removes_only_what_was_never_committed(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, 10)
    torn = make_checkpoint(tmp_path, 30, committed=False)
    staging = RunDir(tmp_path).checkpoint_staging(40)
    staging.mkdir()
    assert sorted(remove_uncommitted(tmp_path)) == sorted([torn, staging])
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_00000010"]


def test_a_run_without_checkpoints_has_no_latest(tmp_path: Path) -> None:
    assert RunDir(tmp_path).latest_checkpoint() is None
    assert remove_uncommitted(tmp_path) == []


def spec_for(data: DataConfig, steps: int, interval: int, **layout: object) -> RunSpec:
    spec = parity_spec(steps, **layout)
    spec.train.checkpoint_interval = interval
    spec.train.keep_checkpoints = 2
    spec.train.async_checkpoint = False  # these tests read the event order of synchronous saves
    return RunSpec.from_dict({**spec.to_dict(), "data": vars(data)})


def resume_from(source_run: Path, step: int, run_dir: Path) -> None:
    """A fresh run folder that holds only the checkpoint of `step`, plus the debris of a crashed save."""
    shutil.copytree(RunDir(source_run).checkpoint(step), RunDir(run_dir).checkpoint(step))
    make_checkpoint(run_dir, step + 1, committed=False)
    RunDir(run_dir).checkpoint_staging(step + 2).mkdir()


def test_a_resumed_run_repeats_the_uninterrupted_losses_bitwise(tiny_data: DataConfig, tmp_path: Path) -> None:
    spec = spec_for(tiny_data, steps=6, interval=3, dp=2)
    whole = launch(spec, tmp_path / "whole", TIMEOUT)
    kinds = [e["kind"] for e in whole]
    assert kinds == ["metrics"] * 3 + ["checkpoint"] + ["metrics"] * 3 + ["checkpoint", "finished"]
    assert set(whole[0]) == {"kind", "time", "step", *METRIC_KEYS}

    resume_from(tmp_path / "whole", 3, tmp_path / "resumed")
    resumed = launch(spec, tmp_path / "resumed", TIMEOUT)
    assert resumed[0]["kind"] == "resumed" and resumed[0]["step"] == 3
    expected = {s: loss for s, loss in step_values(whole).items() if s > 3}
    assert step_values(resumed) == expected  # float equality: bitwise
    assert [p.name for p in RunDir(tmp_path / "resumed").committed_checkpoints()] == ["step_00000003", "step_00000006"]
    assert read_metadata(RunDir(tmp_path / "resumed").checkpoint(6))["sampler"]["consumed"] == 6 * spec.train.global_batch
    # Rank 0's stdout is the run's log that users follow: a line on resume, per step, per checkpoint.
    log = RunDir(tmp_path / "resumed").standalone_log.read_text().splitlines()
    assert any(line.startswith("resumed from step 3 ") for line in log)
    assert [line.split()[1] for line in log if line.startswith("step ")] == ["4/6", "5/6", "6/6"]
    assert any(line.startswith("checkpoint step 6 committed at ") for line in log)


def test_a_finished_run_that_is_started_again_only_reports_it_is_finished(
    tiny_data: DataConfig, tmp_path: Path
) -> None:
    spec = spec_for(tiny_data, steps=2, interval=2)
    launch(spec, tmp_path, TIMEOUT)
    again = launch(spec, tmp_path, TIMEOUT)
    assert [e["kind"] for e in again[-2:]] == ["resumed", "finished"]


def test_async_checkpoints_commit_and_resume_exactly(tiny_data: DataConfig, tmp_path: Path) -> None:
    spec = spec_for(tiny_data, steps=6, interval=2, dp=2, zero=3)
    spec.train.async_checkpoint = True
    whole = launch(spec, tmp_path / "whole", TIMEOUT)
    committed = [e["step"] for e in whole if e["kind"] == "checkpoint"]
    assert committed == [2, 4, 6]
    assert [p.name for p in RunDir(tmp_path / "whole").committed_checkpoints()] == ["step_00000004", "step_00000006"]
    resume_from(tmp_path / "whole", 4, tmp_path / "resumed")
    resumed = launch(spec, tmp_path / "resumed", TIMEOUT)
    assert step_values(resumed) == {s: v for s, v in step_values(whole).items() if s > 4}


@pytest.mark.slow
def test_a_checkpoint_from_four_ranks_resumes_on_two_ranks_in_another_layout(
    tiny_data: DataConfig, tmp_path: Path
) -> None:
    four = spec_for(tiny_data, steps=6, interval=3, dp=2, tp=2, zero=3)
    whole = step_values(launch(four, tmp_path / "four", TIMEOUT))
    two = spec_for(tiny_data, steps=6, interval=3, pp=2)
    resume_from(tmp_path / "four", 3, tmp_path / "two")
    resumed = launch(two, tmp_path / "two", TIMEOUT)
    assert resumed[0] == {**resumed[0], "kind": "resumed", "step": 3}
    losses = step_values(resumed)
    assert sorted(losses) == [4, 5, 6]
    assert max(abs(losses[s] - whole[s]) for s in losses) <= 1e-4


def test_where_a_stager_cannot_be_reused_each_background_save_gets_its_own_and_all_commit(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11.0's DefaultStager fails its second save (pytorch/pytorch#183413): GPU hosts run 2.11.
    monkeypatch.setattr(checkpoint, "stager_is_reusable", lambda: False)
    made: list[DefaultStager] = []
    monkeypatch.setattr(checkpoint, "DefaultStager", lambda options: made.append(DefaultStager(options)) or made[-1])
    spec = parity_spec(2)
    spec.train.async_checkpoint = True
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    committed: list[int] = []
    saver = checkpoint.Checkpointer(
        run_dir=tmp_path, parts=[model], optimizers=[optimizer], spec=spec, tokenizer_dir=tokenizer_dir, rank=0,
        hooks=[], on_commit=lambda step, _: committed.append(step),
    )  # fmt: skip
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(float(step))
        saver.save(step, {"sampler": {"consumed": step}})
        saver.wait()
    saver.close()
    assert committed == [1, 2, 3]
    assert len(made) == 4  # the run's own, then one a save
    restored = torch.nn.Linear(4, 4)
    loader = checkpoint.Checkpointer(
        run_dir=tmp_path, parts=[restored], optimizers=[torch.optim.AdamW(restored.parameters())], spec=spec,
        tokenizer_dir=tokenizer_dir, rank=0, hooks=[],
    )  # fmt: skip
    loader.load(3)
    assert torch.equal(restored.weight, torch.full((4, 4), 3.0))
