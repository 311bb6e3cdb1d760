"""Runs on hosts, measured on PostgreSQL.

First, submit to first step through real processes: two hosts as network namespaces (each a host
worker at its own address, two CPU slots), the web process, a Celery worker with beat and a Redis
broker on the namespaces' bridge. A dp2 run on one host (one node of two ranks) and a dp2 run
spanning both (two nodes of one rank) are submitted in turn, `REPEATS` times each; a run's time is
from the POST to the wall time of its first step's metrics event (the rank's own clock, this
machine's). Medians are printed. Needs root and iproute2 (tools/netns.py).

Then gang placement at scale: one scheduling pass over 10,000 queued runs and 1,000 registered
hosts (rows only: no process starts), devices of mixed sizes, needs of mixed shapes.

The pass is `hosts.scheduling.schedule(RUNS_SIDE)` as the launch task and beat run it: one transaction,
host rows locked, runs offered the free devices in priority then FIFO order. It is timed twice:
the first pass over the fresh queue (it places what fits and writes every waiting reason) and a
second one over what is left (nothing changed: what beat pays every few seconds). Double booking
is checked from the result: no (host, device) claimed twice, no claim beyond a host's devices.

    python -m bench.placement            # ends with one key=value line
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

from bench.netns_cluster import control_plane_on_postgres, netns_cluster
from bench.waiting import wait

DATABASE = "fathom_bench_placement"
HOSTS, RUNS = 1000, 10000
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
        return {shape: statistics.median(values) for shape, values in seconds.items()}


def main() -> None:
    data_dir = control_plane_on_postgres(DATABASE, "fathom-bench-placement-")
    from django.contrib.auth import get_user_model
    from django.db import connection

    from hosts.models import DeviceClaim, Host
    from hosts.scheduling import schedule
    from hosts.tasks import RUNS_SIDE
    from runs.models import Run

    rng = random.Random(15)
    user = get_user_model().objects.create(username="bench")
    first_step = submit_to_first_step(os.environ["DATABASE_URL"], data_dir)
    print(
        f"submit to first step (median of {REPEATS}): one host {first_step['single_host']:.2f} s, "
        f"two hosts {first_step['two_hosts']:.2f} s"
    )
    Run.objects.all().delete()
    Host.objects.all().delete()
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
        runs.append(Run(owner=user, name=f"r{i}", spec=spec, priority=rng.choice((0, 0, 0, 1))))
    Run.objects.bulk_create(runs, batch_size=2000)
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
    waiting = Run.objects.filter(status="queued").exclude(status_reason="").count()
    print(f"claimed {len(claims)} of {devices} devices; {waiting} runs waiting with a reason")
    connection.close()
    print(
        f"clock=wall submit_to_first_step_s={first_step['two_hosts']:.2f} "
        f"single_host_submit_to_first_step_s={first_step['single_host']:.2f} "
        f"schedule_pass_ms={timings[0]:.0f} repeat_pass_ms={timings[1]:.0f} double_booked={double_booked}"
    )


if __name__ == "__main__":
    main()
