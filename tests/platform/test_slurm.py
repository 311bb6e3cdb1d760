"""Runs launched as Slurm jobs (FATHOM_EXECUTOR=slurm) on a real one-machine Slurm cluster.

Real processes throughout: munge, slurmctld and slurmd (tools/slurm_cluster.py), the web
process, a Celery worker with beat (its watch_slurm_jobs reads squeue), and the node agents
that the job's srun starts. The node has 2 CPUs and a dp2 run's job asks for both, so a second
run waits in Slurm's queue while the first runs.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess

import pytest
from rest_framework.authtoken.models import Token

from runs.models import Checkpoint, Run
from runs.tasks import watch_slurm_jobs
from tests.platform.test_run_lifecycle import STORY, api, follow, wait_until
from training.config import RECIPES
from training.run_dir import CheckpointDir

pytestmark = pytest.mark.slow

DP2 = {"layout": {"dp": 2}, "train": {"steps": 6, "checkpoint_interval": 3, "global_batch": 4}}


def squeue_ids(cluster) -> set[str]:
    """The jobs Slurm still has pending or running (squeue's default states)."""
    out = subprocess.run(
        ["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, check=True,
        env=dict(os.environ, **cluster.env()),
    )  # fmt: skip
    return set(out.stdout.split())


def job_field(cluster, job_id: str, field: str) -> str:
    out = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True, env=dict(os.environ, **cluster.env())
    ).stdout
    return re.search(rf"\b{field}=(\S*)", out).group(1)


@pytest.mark.django_db
def test_it_rejects_a_partition_the_cluster_does_not_have(slurm, alice_api, settings):
    settings.EXECUTOR = "slurm"
    response = alice_api.post("/api/runs/", {"name": "r", "slurm": {"partition": "gpu"}}, format="json")
    assert response.status_code == 400
    assert response.json()["slurm"]["partition"] == ["must be one of the cluster's partitions: debug; got 'gpu'"]


def active_run(owner, job_id: str) -> Run:
    return Run.objects.create(
        owner=owner, name="r", spec=RECIPES["tiny"]().to_dict(), status=Run.Status.RUNNING, slurm_job_id=job_id
    )


@pytest.mark.django_db
def test_a_run_whose_job_slurm_no_longer_knows_is_marked_lost(slurm, alice):
    run = active_run(alice, "987654")  # an id this cluster never gave
    assert watch_slurm_jobs() == 1
    run.refresh_from_db()
    assert (run.status, run.status_reason) == ("failed", "lost: Slurm job 987654 is gone (neither squeue nor sacct knows it)")


@pytest.mark.django_db
def test_a_run_whose_job_ended_before_its_agents_reported_fails_saying_how(slurm, alice, tmp_path):
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", "--output=/dev/null", "--wrap=exit 7"],
        capture_output=True, text=True, check=True, env=dict(os.environ, **slurm.env()),
    ).stdout.strip()  # fmt: skip
    run = active_run(alice, job_id)
    wait_until(lambda: job_field(slurm, job_id, "JobState") == "FAILED", 60, "the job to end")
    assert watch_slurm_jobs() == 1
    run.refresh_from_db()
    assert (run.status, run.status_reason) == (
        "failed", f"Slurm job {job_id} ended FAILED (NonZeroExitCode) before its node agents reported an outcome"
    )


@pytest.mark.django_db(transaction=True)
def test_a_dp2_run_submitted_through_the_api_trains_as_a_slurm_job(slurm, alice, live_web, celery_worker_with_beat):
    client = api(live_web, alice)
    dataset = client.post("/api/datasets/", files={"file": ("stories.txt", STORY.encode())}).json()
    options = {"partition": "debug", "account": "lab", "time_limit": "15"}
    created = client.post("/api/runs/", json={"name": "on slurm", "dataset": dataset["id"], "spec": DP2, "slurm": options})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    events = asyncio.run(follow(live_web, Token.objects.get(user=alice).key, run_id))

    run = Run.objects.get(pk=run_id)
    job_id = run.slurm_job_id
    assert job_id.isdigit()
    assert [e["step"] for e in events if e["kind"] == "metrics"] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [3, 6]
    assert any(e["kind"] == "waiting" and e["reason"] == f"waiting: submitted to Slurm as job {job_id}" for e in events)
    assert (run.status, run.step) == ("succeeded", 6)
    # The agent was started by the job: it met at the rendezvous the batch script chose on the
    # job's first node, and the job's own log says which.
    job_log = run.run_dir.slurm_log(job_id).read_text()
    endpoint = re.search(r"rendezvous at (\S+)", job_log).group(1)
    assert [e["rdzv_endpoint"] for e in events if e["kind"] == "agent_started"] == [endpoint]
    assert job_field(slurm, job_id, "JobName") == f"fathom-{run.folder.name}-L1"
    assert job_field(slurm, job_id, "NumCPUs") == "2"
    assert [job_field(slurm, job_id, f) for f in ("Partition", "Account", "TimeLimit")] == ["debug", "lab", "00:15:00"]
    wait_until(lambda: job_field(slurm, job_id, "JobState") == "COMPLETED", 60, "the job to complete")
    assert client.get(f"/api/runs/{run_id}/").json()["slurm_job_id"] == job_id


@pytest.mark.django_db(transaction=True)
def test_a_second_run_waits_in_the_slurm_queue_and_cancels_stop_both_jobs(slurm, alice, live_web, celery_worker_with_beat):
    client = api(live_web, alice)
    long = {"layout": {"dp": 2}, "train": {"steps": 2000, "checkpoint_interval": 2, "global_batch": 4}}
    first = client.post("/api/runs/", json={"name": "holds the node", "spec": long}).json()["id"]
    wait_until(lambda: Checkpoint.objects.filter(run_id=first).exists(), 300, "the first run's first checkpoint")
    second = client.post("/api/runs/", json={"name": "waits", "spec": DP2}).json()["id"]

    def second_waits_for_resources() -> bool:
        return "(Resources)" in client.get(f"/api/runs/{second}/").json()["status_reason"]

    wait_until(second_waits_for_resources, 60, "the second run to show Slurm's reason")
    waiting = client.get(f"/api/runs/{second}/").json()
    second_job = waiting["slurm_job_id"]
    assert waiting["status"] == "queued"
    assert waiting["status_reason"] == (
        f"waiting: Slurm job {second_job} pending, 1st in partition debug: "
        "waiting for resources (the nodes it needs are busy) (Resources)"
    )
    assert job_field(slurm, second_job, "JobState") == "PENDING"

    # Cancelling the waiting run takes its job out of Slurm's queue at once.
    assert client.post(f"/api/runs/{second}/cancel/", json={}).json()["status"] == "cancelled"
    wait_until(lambda: second_job not in squeue_ids(slurm), 30, "the second job to leave the queue")

    # Cancelling the running one: its agents stop the ranks cleanly, the job ends by itself.
    first_job = Run.objects.get(pk=first).slurm_job_id
    assert client.post(f"/api/runs/{first}/cancel/", json={}).status_code == 200
    wait_until(lambda: Run.objects.get(pk=first).status == "cancelled", 120, "the first run to be cancelled")
    wait_until(lambda: first_job not in squeue_ids(slurm), 60, "the first job to leave the queue")
    run = Run.objects.get(pk=first)
    kept = Checkpoint.objects.filter(run=run).order_by("-step").first()
    assert kept is not None and CheckpointDir(run.run_dir.checkpoint(kept.step)).is_committed
    assert run.events.filter(kind="cancelled", source="node-0").exists()  # the agent's own outcome
    # The job ended by itself, with the agent's exit status for "cancelled", not by scancel.
    assert (job_field(slurm, first_job, "JobState"), job_field(slurm, first_job, "ExitCode")) == ("FAILED", "3:0")
