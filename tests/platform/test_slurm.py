"""Runs launched as Slurm jobs (FATHOM_EXECUTOR=slurm) on a real one-machine Slurm cluster.

Real processes throughout: munge, slurmctld and slurmd (tools/slurm_cluster.py), the web
process, a Celery worker with beat (its watch_slurm_jobs reads squeue), and the node agents
that the job's srun starts. A run waiting in Slurm's queue and cancels: tests/e2e/test_slurm_pages.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import subprocess
import time

import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token

from runs.models import Run
from runs.tasks import watch_slurm_jobs
from tests.platform.test_run_lifecycle import STORY, api, follow, wait_until
from tools.check_parity import launch, step_values
from training.config import RECIPES, RunSpec

pytestmark = pytest.mark.slow

DP2 = {"layout": {"dp": 2}, "train": {"steps": 6, "checkpoint_interval": 3, "global_batch": 4}}


def squeue_ids(cluster) -> set[str]:
    """The jobs Slurm still has pending or running (squeue's default states)."""
    out = subprocess.run(
        ["squeue", "--noheader", "--format=%i"], capture_output=True, text=True, check=True,
        env=dict(os.environ, **cluster.env()),
    )  # fmt: skip
    return set(out.stdout.split())


def show_job(cluster, job_id: str) -> str:
    return subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True, env=dict(os.environ, **cluster.env())
    ).stdout


def job_field(cluster, job_id: str, field: str) -> str:
    return re.search(rf"\b{field}=(\S*)", show_job(cluster, job_id)).group(1)


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
        "failed", f"Slurm job {job_id} ended FAILED (NonZeroExitCode) before the run finished"
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
    # Its port is one of the rendezvous ports, below the range outgoing connections take theirs from.
    assert int(endpoint.rsplit(":", 1)[1]) in settings.RENDEZVOUS_PORTS
    assert job_field(slurm, job_id, "JobName") == f"fathom-{run.folder.name}-L1"
    assert job_field(slurm, job_id, "NumCPUs") == "2"
    assert [job_field(slurm, job_id, f) for f in ("Partition", "Account", "TimeLimit")] == ["debug", "lab", "00:15:00"]
    wait_until(lambda: job_field(slurm, job_id, "JobState") == "COMPLETED", 60, "the job to complete")
    assert client.get(f"/api/runs/{run_id}/").json()["slurm_job_id"] == job_id


def what_slurm_says(cluster, job_id: str) -> str:
    """The job's state as scontrol shows it, and slurmctld's last lines about it."""
    job = show_job(cluster, job_id).split()
    said = (cluster.state / "log" / "slurmctld.log").read_text().splitlines()
    state = " ".join(w for w in job if w.split("=")[0] in ("JobState", "Reason", "Restarts", "EligibleTime"))
    logged = " | ".join([line for line in said if f"JobId={job_id}" in line][-12:])
    return f"Slurm: {state}; slurmctld: {logged}"


def wait_for_run(client, run_id: int, cluster, job_id: str, predicate, timeout: float, what: str) -> dict:
    """wait_until on the run as the API shows it, which it returns; a timeout says what the run
    and Slurm's job were at the end, and what slurmctld logged of the job."""
    last: dict = {}

    def check() -> bool:
        last.update(client.get(f"/api/runs/{run_id}/").json())
        return predicate(last)

    try:
        wait_until(check, timeout, what)
    except AssertionError as exc:
        run = {k: v for k, v in last.items() if k in ("status", "status_reason", "step", "slurm_job_id")}
        raise AssertionError(f"{exc}; the run: {run}; {what_slurm_says(cluster, job_id)}") from None
    return last


def scontrol(cluster, *args: str) -> None:
    subprocess.run(["scontrol", *args], capture_output=True, text=True, check=True, env=dict(os.environ, **cluster.env()))


@pytest.mark.django_db(transaction=True)
def test_a_job_slurm_requeues_resumes_the_run_from_its_checkpoint_on_the_same_loss_curve(
    slurm, alice, live_web, celery_worker_with_beat
):
    client = api(live_web, alice)
    # Rank 1 freezes at step 18 (once, and no hang timeout within the test), so the job is
    # stopped after the checkpoint of step 12 and before any other, whatever the machine's speed.
    # The save is synchronous: a background one is committed only once every rank's write is in,
    # and a rank frozen before that (seen on a loaded machine, where steps 13 to 17 took a second)
    # leaves it uncommitted until gloo's 120 s timeout ends the step and the run resumes without it.
    spec = {
        "layout": {"dp": 2},
        "train": {"steps": 24, "checkpoint_interval": 12, "global_batch": 4, "async_checkpoint": False},
        "nodes": {"heartbeat_timeout": 600}, "faults": [{"kind": "hang_rank", "rank": 1, "step": 18}],
    }  # fmt: skip
    run_id = client.post("/api/runs/", json={"name": "requeued", "spec": spec}).json()["id"]
    # The requeue comes once rank 1 froze. Sent sooner (a CI run sent it between steps 15 and
    # 18), it stops the job before the fault fires; the fault then fires in the requeued job,
    # gloo's 120 s timeout ends that step, and the run resumes a second time, from the snapshot
    # taken at the failure (step 17).
    faults = Run.objects.get(pk=run_id).run_dir.faults_dir
    wait_until(
        lambda: client.get(f"/api/runs/{run_id}/checkpoints/").json() and any(faults.glob("hang_rank-*.fired")),
        300, "the checkpoint of step 12 and rank 1 frozen at step 18",
    )  # fmt: skip
    job_id = client.get(f"/api/runs/{run_id}/").json()["slurm_job_id"]

    # As a preemption or a node failure that Slurm reports does: SIGTERM to the job's processes
    # (the agents stop), and back to the queue.
    scontrol(slurm, "requeue", job_id)
    # Slurm lists the job as pending once every process of it has exited (SIGKILL after KillWait,
    # 10 s), and holds it there 2 minutes: the wait may take all but the end of that hold.
    requeued = f"requeued by Slurm: Slurm job {job_id} pending"
    wait_for_run(client, run_id, slurm, job_id, lambda r: r["status_reason"].startswith(requeued), 110, "the requeue")
    assert client.get(f"/api/runs/{run_id}/").json()["status"] == "restarting"
    # Slurm holds a requeued job 2 minutes; the test starts it sooner, but not within the requeue's
    # second: its slurmd revokes the last start's credential, and a start in that same second was
    # killed ("Job credential revoked") and the job ended FAILED.
    time.sleep(2)
    scontrol(slurm, "update", f"JobId={job_id}", "StartTime=now")
    finished = ("succeeded", "failed", "cancelled")
    ended = wait_for_run(client, run_id, slurm, job_id, lambda r: r["status"] in finished, 300, "the run to finish")
    assert ended["status"] == "succeeded", f"the run: {ended['status']} ({ended['status_reason']}); {what_slurm_says(slurm, job_id)}"

    run = Run.objects.get(pk=run_id)
    assert run.slurm_job_id == job_id and run.status_reason == ""
    history = list(run.events.exclude(kind="metrics").values_list("kind", "data"))
    kinds = [kind for kind, _ in history]
    assert kinds.count("agent_started") == 2 and "stopped" in kinds and "cancelled" not in kinds, history
    resumed = [data["step"] for kind, data in history if kind == "resumed"]
    assert resumed == [12], history
    losses: dict[int, list[float]] = {}
    for step, loss in run.events.filter(kind="metrics").order_by("seq").values_list("data__step", "data__loss"):
        losses.setdefault(step, []).append(loss)
    assert sorted(losses) == list(range(1, 25))
    repeated = {step: seen for step, seen in losses.items() if len(seen) > 1}
    assert {13, 14, 15} <= set(repeated) and min(repeated) == 13
    assert all(seen[0] == seen[1] for seen in repeated.values()), repeated  # bitwise: the same curve


@pytest.fixture
def signal_lead_of_5_s(monkeypatch):
    """The time-limit signal 5 s ahead (set before the web process and the Celery worker start):
    the default lead (300 s) is longer than a 1-minute time limit. Slurm checks time limits every
    30 s and signals once about the lead + 30 s are left: some 25 to 55 s into a job, which
    leaves a job of this test 5 to 35 s of training after its start (~20 s on this 2-core host);
    the kill comes at the first check past the limit, at least 30 s after the signal."""
    monkeypatch.setenv("FATHOM_SLURM_SIGNAL_LEAD", "5")


@pytest.mark.django_db(transaction=True)
def test_a_job_at_its_time_limit_checkpoints_on_the_signal_and_its_requeued_job_finishes_on_the_same_loss_curve(
    slurm, signal_lead_of_5_s, alice, live_web, celery_worker_with_beat, tmp_path
):
    client = api(live_web, alice)
    # At least 60 s of training (rank 0 waits 0.2 s at each step's start, however fast the host:
    # on a quiet one 400 steps alone took 26 s and finished inside the first job), more than one
    # job of a 1-minute time limit holds: its signal comes at most 55 s into it, its agent and
    # ranks take seconds to start. The only periodic checkpoint is the last step's, so any other
    # was the signal's.
    steps = 300
    spec = {
        "layout": {"dp": 2},
        "train": {"steps": steps, "checkpoint_interval": steps, "global_batch": 4},
        "faults": [{"kind": "slow_steps", "rank": 0, "step": 1}],
    }
    created = client.post("/api/runs/", json={"name": "time-limited", "spec": spec, "slurm": {"time_limit": "1"}})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    requeue_seen_at: float | None = None

    def finished_starting_requeued_jobs_now() -> bool:
        nonlocal requeue_seen_at
        run = client.get(f"/api/runs/{run_id}/").json()
        if run["status"] == "restarting" and run["status_reason"].startswith("requeued by Slurm"):
            requeue_seen_at = requeue_seen_at or time.monotonic()
            # Slurm holds a requeued job 2 minutes before it may start again (its slurmd keeps the
            # last start's credential revoked meanwhile). The test starts it 2 s after the requeue:
            # one started within the same second was killed ("Job credential revoked") and the
            # job ended FAILED.
            if time.monotonic() - requeue_seen_at >= 2:
                subprocess.run(
                    ["scontrol", "update", f"JobId={run['slurm_job_id']}", "StartTime=now"],
                    capture_output=True, env=dict(os.environ, **slurm.env()),
                )  # fmt: skip
        else:
            requeue_seen_at = None
        return run["status"] in ("succeeded", "failed", "cancelled")

    wait_until(finished_starting_requeued_jobs_now, 900, "the run to finish")
    run = Run.objects.get(pk=run_id)
    assert (run.status, run.step) == ("succeeded", steps), run.status_reason
    job_id = run.slurm_job_id
    events = list(run.events.order_by("seq").values("kind", "time", "data"))

    # Each job but the last was signalled, its ranks checkpointed the step they were at, and its
    # agent stopped; the job then requeued itself and the next one resumed from that very step.
    stops = [e["data"]["step"] for e in events if e["kind"] == "stop_requested"]
    assert stops and stops == sorted(stops) and stops[-1] < steps
    assert [e["data"]["step"] for e in events if e["kind"] == "checkpoint"] == [*stops, steps]
    assert [e["data"]["step"] for e in events if e["kind"] == "resumed"] == stops
    reason = f"the time limit of Slurm job {job_id} is 5 s away"
    assert [e["data"]["reason"] for e in events if e["kind"] == "stop_requested"] == [reason] * len(stops)
    assert [e["data"]["reason"] for e in events if e["kind"] == "stopped"] == [
        f"checkpointed step {step} as the scheduler asked: {reason}" for step in stops
    ]
    assert [e["kind"] for e in events].count("agent_started") == len(stops) + 1
    # The job's log, one part per start: each start but the last was signalled once and requeued
    # itself from the step its ranks checkpointed.
    job_log = run.run_dir.slurm_log(job_id).read_text()
    starts = re.split(r"^fathom: job \d+ started at .*$", job_log, flags=re.M)[1:]
    assert len(starts) == len(stops) + 1, job_log
    requeued = [re.findall(r"checkpointed step (\d+) for the time limit .*; requeueing", part) for part in starts]
    assert requeued == [*([str(step)] for step in stops), []], job_log
    signalled = [[float(t) for t in re.findall(r"time-limit signal at (\S+):", part)] for part in starts]
    assert all(len(times) == 1 for times in signalled[:-1]), job_log
    # The step checkpointed is the one that ended after the signal (the request is written after
    # the log line, and rank 0 reports a step's metrics after agreeing on the request).
    step_ended = {e["data"]["step"]: e["time"].timestamp() for e in events if e["kind"] == "metrics"}
    assert all(step_ended[step] > times[0] for step, times in zip(stops, signalled, strict=False))
    # The last start may be signalled too (Slurm signals up to a minute early), but only once its
    # ranks had looked for the request at the step before the last: a stop agreed at the last step
    # is no stop, the run just finishes, and the job is not requeued.
    assert len(signalled[-1]) <= 1 and all(at > step_ended[steps - 2] for at in signalled[-1]), job_log

    # Every step ran once, and the curve is an uninterrupted run's, bit for bit.
    losses = [(e["data"]["step"], e["data"]["loss"]) for e in events if e["kind"] == "metrics"]
    assert [step for step, _ in losses] == list(range(1, steps + 1))
    # (Without the slow steps: a wait changes no value, only the time the reference takes.)
    uninterrupted = dataclasses.replace(RunSpec.from_json(run.run_dir.spec_file.read_text()), faults=[])
    reference = launch(uninterrupted, tmp_path / "uninterrupted", 600)
    assert dict(losses) == step_values(reference)
