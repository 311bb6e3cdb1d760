"""Gang placement at scale, on PostgreSQL: one scheduling pass over 10,000 queued runs and 1,000
registered hosts (rows only: no process starts), devices of mixed sizes, needs of mixed shapes.

The pass is `hosts.scheduling.schedule()` as the launch task and beat run it: one transaction,
host rows locked, runs offered the free devices in priority then FIFO order. It is timed twice:
the first pass over the fresh queue (it places what fits and writes every waiting reason) and a
second one over what is left (nothing changed: what beat pays every few seconds). Double booking
is checked from the result: no (host, device) claimed twice, no claim beyond a host's devices.

    python -m bench.placement            # ends with one key=value line
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATABASE = "fathom_bench_placement"
HOSTS, RUNS = 1000, 10000


def fresh_database() -> str:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DATABASE} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DATABASE}")
    return f"postgres://postgres@127.0.0.1:5432/{DATABASE}"


def main() -> None:
    os.environ["DATABASE_URL"] = fresh_database()
    os.environ.setdefault("FATHOM_DATA_DIR", str(Path("/tmp/fathom-bench-placement")))
    for folder in (str(REPO), str(REPO / "platform")):
        sys.path.insert(0, folder)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from django.db import connection

    from hosts.models import DeviceClaim, Host
    from hosts.scheduling import schedule
    from runs.models import Run

    call_command("migrate", verbosity=0)
    rng = random.Random(15)
    user = get_user_model().objects.create(username="bench")
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
        placed = schedule()
        elapsed_ms = (time.perf_counter() - started) * 1000
        timings.append(elapsed_ms)
        print(f"{name} pass: {elapsed_ms:.0f} ms, placed {len(placed)} runs")

    claims = list(DeviceClaim.objects.values_list("host_id", "device"))
    sizes = {h.pk: len(h.devices) for h in hosts}
    double_booked = len(claims) - len(set(claims)) + sum(1 for host, device in claims if device >= sizes[host])
    waiting = Run.objects.filter(status="queued").exclude(status_reason="").count()
    print(f"claimed {len(claims)} of {devices} devices; {waiting} runs waiting with a reason")
    connection.close()
    print(f"schedule_pass_ms={timings[0]:.0f} repeat_pass_ms={timings[1]:.0f} double_booked={double_booked}")


if __name__ == "__main__":
    main()
