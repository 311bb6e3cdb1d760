"""Runs on hosts, measured on PostgreSQL.

First, submit to first step through real processes: two hosts as network namespaces (each a host
worker at its own address, two CPU slots), the web process, a Celery worker with beat and a Redis
broker on the namespaces' bridge. A dp2 run on one host (one node of two ranks) and a dp2 run
spanning both (two nodes of one rank) are submitted in turn, `REPEATS` times each; a run's time is
from the POST to the wall time of its first step's metrics event (the rank's own clock, this
machine's). Medians are printed. Needs root and iproute2 (tools/netns.py).

On the same cluster, a preemption (issue 36): a low-priority run fills both hosts (two nodes of two
ranks, rank 0 slowed by 0.2 s a step so it outlasts what follows), then a user whose ceiling allows
it submits a priority-5 run of the same shape. `preempt_to_first_step_s` is from that submit to the
high run's first step (the low run checkpoints the step its ranks agree on, stops, goes back to
the queue; its hosts' beats give its devices back; the high run starts on them). Once the low run
has resumed and finished, its losses are compared with the same spec run by torchrun alone,
untouched: `preempted_resume_bitwise=1` when every step's loss is equal.

Then gang placement at scale: one scheduling pass over 10,000 queued runs of 200 users and 1,000
registered hosts (rows only: no process starts), devices of mixed sizes, needs of mixed shapes; 40
users have a quota of 24 GPUs, and 2,000 runs that ended in the last two days give the users
recent use for fair share.

The pass is `hosts.scheduling.schedule(RUNS_SIDE)` as the launch task and beat run it: one transaction,
host rows locked, runs offered the free devices in fair-share order, quotas checked, the head of
the queue holding its reservation and the runs behind it backfilling around it. It is timed twice:
the first pass over the fresh queue (it places what fits and writes every waiting reason) and a
second one over what is left (nothing changed: what beat pays every few seconds). Checked from the
result: double booking (a (host, device) claimed twice, a claim beyond a host's devices), quota
violations (a user with a quota holding more GPUs than it), and whether backfill delayed the head:
the runs its reservation waits for end, and the next pass must start it (`backfill_delayed_head=0`).

    python -m bench.placement            # ends with one key=value line
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

from bench.netns_cluster import control_plane_on_postgres, netns_cluster
from bench.waiting import wait

DATABASE = "fathom_bench_placement"
HOSTS, RUNS = 1000, 10000
USERS, LIMITED_USERS, QUOTA_GPUS = 200, 40, 24
ENDED = 2000  # runs that ended within two days: the users' recent use
REPEATS = 3
TRAIN = {"steps": 3, "warmup_steps": 1, "checkpoint_interval": 3}
SHAPES = {
    "single_host": {"layout": {"dp": 2}, "train": TRAIN},
    "two_hosts": {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN},
}


def submit_to_first_step(database_url: str, data_dir: Path) -> dict[str, float]:
    """Median seconds from submit to the first step, per shape, on two namespace hosts."""
    import httpx
    from rest_framework.authtoken.models import Token

    from runs.models import Run, RunEvent

    token = Token.objects.get_or_create(user=Run._meta.get_field("owner").related_model.objects.get(username="bench"))[
        0
    ].key
    with netns_cluster(database_url, data_dir, FATHOM_SCHEDULE_INTERVAL="1") as cluster:
        api = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Token {token}"}, timeout=60)
        seconds: dict[str, list[float]] = {shape: [] for shape in SHAPES}
        for attempt in range(REPEATS):
            for shape, spec in SHAPES.items():
                submitted = time.time()
                run_id = api.post("/api/runs/", json={"name": f"{shape}-{attempt}", "spec": spec}).json()["id"]
                first = wait(
                    lambda run_id=run_id: RunEvent.objects.filter(run_id=run_id, kind="metrics").order_by("seq").first(),
                    300, "first step",
                )  # fmt: skip
                seconds[shape].append(first.time.timestamp() - submitted)
                wait(lambda run_id=run_id: Run.objects.get(pk=run_id).status in Run.FINISHED, 300, "the run's end")
                print(f"{shape} attempt {attempt}: first step {seconds[shape][-1]:.2f} s after submit")
        medians = {shape: statistics.median(values) for shape, values in seconds.items()}
        medians.update(preemption(api))
        return medians


def preemption(api) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Seconds from a priority-5 submit to its first step on a cluster a low run fills, and
    whether the preempted run resumed on its untouched curve (1.0) or not (0.0)."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from hosts.models import Quota
    from runs.models import Run, RunEvent
    from tools.check_parity import launch, step_values
    from training.config import RunSpec

    urgent_user = get_user_model().objects.create(username="urgent")
    Quota.objects.create(user=urgent_user, priority_ceiling=5)
    token = Token.objects.create(user=urgent_user).key
    low_spec = {"layout": {"dp": 4}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 2},
                "train": {"steps": 120, "checkpoint_interval": 120, "global_batch": 8},
                "faults": [{"kind": "slow_steps", "rank": 0, "step": 1}]}  # fmt: skip
    low = api.post("/api/runs/", json={"name": "low", "spec": low_spec}).json()["id"]
    wait(lambda: Run.objects.get(pk=low).step >= 5, 300, "the low run to train")
    submitted = time.time()
    high = api.post("/api/runs/", json={"name": "high", "spec": low_spec | {"faults": [], "train": TRAIN}, "priority": 5},
                    headers={"Authorization": f"Token {token}"}).json()["id"]  # fmt: skip
    first = wait(lambda: RunEvent.objects.filter(run_id=high, kind="metrics").order_by("seq").first(), 300, "the high run's first step")
    to_first_step = first.time.timestamp() - submitted
    print(f"preemption: the priority-5 run's first step {to_first_step:.2f} s after its submit; where the time went:")
    timeline = RunEvent.objects.filter(run_id__in=[low, high], time__gte=datetime.fromtimestamp(submitted, UTC))
    for run_id, kind, at, data in timeline.order_by("time").values_list("run_id", "kind", "time", "data"):
        if kind != "metrics" or at <= first.time:
            detail = data.get("status") or data.get("reason") or data.get("step") or ""
            print(f"  {at.timestamp() - submitted:6.2f} s  {'high' if run_id == high else 'low '}  {kind} {detail}")
    wait(lambda: Run.objects.get(pk=low).status in Run.FINISHED, 600, "the low run's end")
    run = Run.objects.get(pk=low)
    losses = dict(run.events.filter(kind="metrics").values_list("data__step", "data__loss"))
    stops = list(run.events.filter(kind="stop_requested").values_list("data__step", flat=True))
    spec = RunSpec.from_json(run.run_dir.spec_file.read_text())
    reference = step_values(launch(RunSpec.from_dict({**spec.to_dict(), "faults": []}), run.folder.parent / "untouched", 900))
    bitwise = run.status == "succeeded" and len(stops) == 1 and losses == reference
    print(f"preemption: the low run {run.status}, stopped at step {stops}, {len(losses)} steps; equal to untouched: {bitwise}")
    return {"preempt_to_first_step": to_first_step, "preempted_resume_bitwise": float(bitwise)}


def main() -> None:
    data_dir = control_plane_on_postgres(DATABASE, "fathom-bench-placement-")
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.utils import timezone

    from hosts.models import DeviceClaim, Host, Quota
    from hosts.scheduling import schedule
    from hosts.tasks import RUNS_SIDE
    from runs.models import Run

    rng = random.Random(15)
    user = get_user_model().objects.create(username="bench")
    users = [user, *get_user_model().objects.bulk_create(get_user_model()(username=f"u{i}") for i in range(USERS - 1))]
    first_step = submit_to_first_step(os.environ["DATABASE_URL"], data_dir)
    print(
        f"submit to first step (median of {REPEATS}): one host {first_step['single_host']:.2f} s, "
        f"two hosts {first_step['two_hosts']:.2f} s"
    )
    Run.objects.all().delete()
    Host.objects.all().delete()
    Quota.objects.all().delete()
    limited = users[:LIMITED_USERS]
    Quota.objects.bulk_create(Quota(user=u, gpus=QUOTA_GPUS) for u in limited)
    hosts = Host.objects.bulk_create(
        Host(
            name=f"h{i:04d}", address=f"10.{i // 250}.{i % 250}.1", status="ready",
            devices=[{"index": d, "kind": "gpu", "model": "H100", "memory_mb": 81559} for d in range(rng.choice((1, 2, 4, 8)))],
        )
        for i in range(HOSTS)
    )  # fmt: skip
    shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 8)]  # (nodes, devices per node)
    runs = []
    for i in range(RUNS):
        nodes, per_node = rng.choice(shapes)
        spec = {"layout": {"dp": nodes * per_node}, "nodes": {"min": nodes, "max": nodes, "nproc_per_node": per_node}}
        runs.append(Run(owner=rng.choice(users), name=f"r{i}", spec=spec, priority=rng.choice((0, 0, 0, 1))))
    Run.objects.bulk_create(runs, batch_size=2000)
    now = timezone.now()
    ended = []
    for i in range(ENDED):
        began = now - timedelta(hours=rng.uniform(1, 48))
        ended.append(Run(
            owner=rng.choice(users), name=f"e{i}", spec={"layout": {"dp": rng.choice((1, 2, 4, 8))}}, status="succeeded",
            started_at=began, finished_at=began + timedelta(minutes=rng.uniform(5, 60)),
        ))  # fmt: skip
    Run.objects.bulk_create(ended, batch_size=2000)
    devices = sum(len(h.devices) for h in hosts)
    print(f"{HOSTS} hosts with {devices} GPUs (1, 2, 4 or 8 each); {RUNS} queued runs of shapes {shapes}")

    timings = []
    for name in ("first", "second"):
        started = time.perf_counter()
        placed = schedule(RUNS_SIDE)
        elapsed_ms = (time.perf_counter() - started) * 1000
        timings.append(elapsed_ms)
        print(f"{name} pass: {elapsed_ms:.0f} ms, placed {len(placed)} runs")

    claims = list(DeviceClaim.objects.values_list("host_id", "device"))
    sizes = {h.pk: len(h.devices) for h in hosts}
    double_booked = len(claims) - len(set(claims)) + sum(1 for host, device in claims if device >= sizes[host])
    waiting = Run.objects.filter(status="queued").count()
    held = Counter(DeviceClaim.objects.filter(run__owner__in=limited).values_list("run__owner_id", flat=True))
    quota_violations = sum(1 for count in held.values() if count > QUOTA_GPUS)
    at_quota = Run.objects.filter(status="queued", status_reason__startswith="quota:").count()
    print(f"claimed {len(claims)} of {devices} devices; {waiting} runs waiting: {at_quota} at their quota, one at the head, "
          "the rest behind it; "
          f"most GPUs one limited user holds: {max(held.values(), default=0)} of {QUOTA_GPUS}")  # fmt: skip

    # The runs the head's reservation waits for end (their claims go); the next pass must start it.
    head = Run.objects.exclude(reservation={}).get()
    backfilled = Run.objects.filter(status="starting").count()
    print(f"head of the queue: run {head.pk} ({head.status_reason})")
    Run.objects.filter(pk__in=head.reservation["until"]).update(status="succeeded", finished_at=timezone.now())
    DeviceClaim.objects.filter(run_id__in=head.reservation["until"]).delete()
    started = schedule(RUNS_SIDE)
    backfill_delayed_head = int(head.pk not in started)
    print(f"after the {len(head.reservation['until'])} runs it waited for ended, the next pass started {len(started)} runs, "
          f"the head {'among them' if not backfill_delayed_head else 'NOT among them'} ({backfilled} runs had started)")  # fmt: skip
    connection.close()
    print(
        f"clock=wall submit_to_first_step_s={first_step['two_hosts']:.2f} "
        f"single_host_submit_to_first_step_s={first_step['single_host']:.2f} "
        f"preempt_to_first_step_s={first_step['preempt_to_first_step']:.2f} "
        f"preempted_resume_bitwise={first_step['preempted_resume_bitwise']:.0f} "
        f"schedule_pass_ms={timings[0]:.0f} repeat_pass_ms={timings[1]:.0f} double_booked={double_booked} "
        f"quota_violations={quota_violations} backfill_delayed_head={backfill_delayed_head}"
    )


if __name__ == "__main__":
    main()
