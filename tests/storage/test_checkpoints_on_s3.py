"""Checkpoints on object storage: a real S3 server (moto's), s3fs in the ranks, real agents and torchrun.

The run folder keeps only what its host needs (logs, events, spool); every checkpoint object is
on S3, so these runs share no checkpoint folder with anyone.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.faults.harness import Agents, training_spec
from tools.check_parity import launch, step_values
from tools.s3_server import S3Server
from training.checkpoint_storage import StoredCheckpoints
from training.config import RunSpec
from training.run_dir import RunDir, storage_checkpoints_url

pytestmark = pytest.mark.slow

TIMEOUT = 600


def on_storage(spec: RunSpec, storage: str, **layout: Any) -> RunSpec:
    data = spec.to_dict()
    data["data"]["storage"] = storage
    data["layout"].update(layout)
    # Resume must come from S3, not from a rank's in-memory snapshot on a surviving host.
    data["train"]["memory_snapshots"] = False
    return RunSpec.from_dict(data)


def stored(s3: S3Server, prefix: str, run_dir: Path) -> StoredCheckpoints:
    return StoredCheckpoints(storage_checkpoints_url(s3.url(prefix), run_dir.name))


def test_a_dp2_tp2_run_killed_mid_run_resumes_from_s3_on_the_uninterrupted_loss_curve(
    agents: Agents, tmp_path: Path, s3: S3Server
) -> None:
    clean = agents.run(on_storage(training_spec(), "", tp=2), tmp_path / "clean")  # on local disk
    assert clean.process.returncode == 0, clean.tail()

    spec = on_storage(training_spec(faults=[{"kind": "kill_rank", "rank": 1, "step": 7}]), s3.url("killed"), tp=2)
    faulty = agents.run(spec, tmp_path / "faulty")
    assert faulty.process.returncode == 0, faulty.tail()
    # One failure, the injected one; a rank that failed of anything else shows its log's end here
    # (a crash's stacks included: faulthandler prints them there).
    failures = faulty.of_kind("rank_failed")
    logs = "\n".join((faulty.run_dir / "logs" / f"rank{f['rank']}.log").read_text()[-4000:] for f in failures)
    assert [(f["rank"], f["signal"]) for f in failures] == [(1, "SIGKILL")], f"{failures}\n{logs}"
    (resumed,) = faulty.of_kind("resumed")
    checkpoints = stored(s3, "killed", tmp_path / "faulty")
    assert (resumed["step"], resumed["path"]) == (4, checkpoints.url_of(4))
    assert faulty.losses() == clean.losses()  # float equality: bitwise
    assert sorted(faulty.losses()) == list(range(1, 13))
    assert checkpoints.committed_steps() == [4, 8, 12]
    assert not RunDir(tmp_path / "faulty").checkpoints_dir.exists()
    # The agent sees the run's progress on S3 too: what the timeline says it restarts from and
    # ends at (and what gives a run that checkpoints its restart budget back).
    assert [r["from_step"] for r in faulty.of_kind("restarting")] == [4]
    assert [s["step"] for s in faulty.of_kind("succeeded")] == [12]


def test_a_checkpoint_on_s3_resumes_on_another_layout(tmp_path: Path, s3: S3Server) -> None:
    spec = on_storage(training_spec(steps=6, checkpoint_interval=3), s3.url("layouts"), tp=2)
    four = step_values(launch(spec, tmp_path / "four", TIMEOUT))
    source = stored(s3, "layouts", tmp_path / "four")
    target = stored(s3, "layouts", tmp_path / "two")
    source.fs.copy(source.path_of(3), target.path_of(3), recursive=True)

    two = on_storage(training_spec(steps=6, checkpoint_interval=3), s3.url("layouts"), tp=1, pp=2, microbatches=2)
    resumed = launch(two, tmp_path / "two", TIMEOUT)
    assert resumed[0] == {**resumed[0], "kind": "resumed", "step": 3, "path": target.url_of(3)}
    losses = step_values(resumed)
    assert sorted(losses) == [4, 5, 6]
    # Another layout reduces in another order: equal to float rounding, as from local disk.
    assert max(abs(losses[s] - four[s]) for s in losses) <= 1e-4
    assert target.committed_steps() == [3, 6]

    # The control plane's export reads the checkpoint where it is (`python -m training.export URL OUT`);
    # the weights equal those exported from a local copy of the same objects.
    subprocess.run([sys.executable, "-m", "training.export", target.url_of(6), str(tmp_path / "from-s3")], check=True)
    target.fs.get(target.path_of(6), str(tmp_path / "copy"), recursive=True)
    subprocess.run([sys.executable, "-m", "training.export", str(tmp_path / "copy"), str(tmp_path / "from-disk")], check=True)
    from_s3, from_disk = (load_file(tmp_path / name / "model.safetensors") for name in ("from-s3", "from-disk"))
    assert from_s3.keys() == from_disk.keys() and all(from_s3[k].equal(from_disk[k]) for k in from_s3)
    assert (tmp_path / "from-s3" / "tokenizer.json").read_bytes() == (tmp_path / "from-disk" / "tokenizer.json").read_bytes()


def test_a_writer_killed_before_its_checkpoint_is_marked_leaves_the_previous_one_the_latest(
    agents: Agents, tmp_path: Path, s3: S3Server
) -> None:
    # Rank 1 dies once every shard and DCP's metadata of step 8 are uploaded, before the marker.
    spec = on_storage(
        training_spec(faults=[{"kind": "kill_during_checkpoint", "rank": 1, "step": 8}]), s3.url("torn")
    )
    run = agents.run(spec, tmp_path / "run")
    assert run.process.returncode == 0, run.tail()
    kinds = [(e["kind"], e["data"].get("step")) for e in run.events]
    failed_at = kinds.index(("rank_failed", None))
    assert ("checkpoint", 8) not in kinds[:failed_at]
    checkpoints = stored(s3, "torn", tmp_path / "run")
    assert [(r["step"], r["path"]) for r in run.of_kind("resumed")] == [(4, checkpoints.url_of(4))]
    assert ("checkpoint", 8) in kinds[failed_at:]  # saved again by the resumed run
    assert sorted(run.losses()) == list(range(1, 13))
    # The torn upload was removed before the resumed run wrote step 8 again; only marked ones remain.
    assert checkpoints.committed_steps() == [4, 8, 12]
    assert checkpoints.remove_uncommitted() == []
