"""Submit to first step through Slurm vs the hosts executor, on this machine, in one run.

Real processes: a one-machine Slurm cluster (tools/slurm_cluster.py), the web process and a
Celery worker with beat, on a fresh SQLite database in a temporary data dir. The same tiny dp2
run is submitted through the API `REPEATS` times under FATHOM_EXECUTOR=slurm, then (web and
worker started again) `REPEATS` times under the hosts executor, with one host worker of 2 CPU
slots at 127.0.0.1. A run's time is from the POST to the wall time of its first step's metrics
event (the rank's own clock, this machine's). For Slurm, the scheduler's own part is reported
apart: from the launch's `waiting: submitted to Slurm` event (recorded as sbatch answered) to
the job's start, which the batch script's first line stamps (`date +%s.%N`; squeue's times
are whole seconds).

    python -m bench.slurm            # ends with one key=value line
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from bench.waiting import answers, free_port, stop_all, wait

REPO = Path(__file__).resolve().parents[1]
REPEATS = 3
JOIN_TOKEN = "bench-join-token"
SPEC = {"layout": {"dp": 2}, "train": {"steps": 3, "warmup_steps": 1, "checkpoint_interval": 3}}


def measure(executor: str, env: dict[str, str], logs: Path, token: str) -> list[tuple[float, float | None]]:
    """(submit → first step, sbatch answered → job started or None) per run, under `executor`."""
    import httpx

    from controlplane.web import web_command
    from hosts.models import Host
    from runs.models import Run, RunEvent

    port = int(env["FATHOM_PUBLIC_URL"].rsplit(":", 1)[1])
    processes: list[subprocess.Popen[bytes]] = []

    def start(name: str, command: list[str], cwd: Path, **extra: str) -> None:
        with (logs / f"{executor}-{name}.log").open("ab") as out:
            processes.append(subprocess.Popen(command, cwd=cwd, env={**env, **extra}, stdout=out, stderr=subprocess.STDOUT))

    results: list[tuple[float, float | None]] = []
    try:
        start("web", web_command(port), REPO / "platform")
        wait(lambda: answers(f"{env['FATHOM_PUBLIC_URL']}/login/"), 60, "the web process")
        start("worker", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-B", "--pool=threads",
                         "--concurrency=4", "--schedule", str(logs / f"{executor}-beat"), "--without-gossip",
                         "--without-mingle", "--without-heartbeat"], REPO / "platform")  # fmt: skip
        if executor == "hosts":
            start("host", [sys.executable, "-m", "hostworker"], REPO, FATHOM_HOST_NAME="local", FATHOM_HOST_CPU_SLOTS="2")
            wait(lambda: Host.objects.filter(status="ready").exists(), 120, "a ready host")
        api = httpx.Client(base_url=env["FATHOM_PUBLIC_URL"], headers={"Authorization": f"Token {token}"}, timeout=60)
        for attempt in range(REPEATS):
            submitted = time.time()
            answer = api.post("/api/runs/", json={"name": f"{executor}-{attempt}", "spec": SPEC})
            answer.raise_for_status()
            run_id = answer.json()["id"]
            first = wait(
                lambda run_id=run_id: RunEvent.objects.filter(run_id=run_id, kind="metrics").order_by("seq").first(),
                300, "first step",
            )  # fmt: skip
            wait(lambda run_id=run_id: Run.objects.get(pk=run_id).status in Run.FINISHED, 300, "the run's end")
            scheduler: float | None = None
            if executor == "slurm":
                run = Run.objects.get(pk=run_id)
                answered = RunEvent.objects.filter(run=run, kind="waiting").order_by("seq").first()
                started = job_start(run.run_dir.slurm_log(run.slurm_job_id))
                scheduler = started - answered.time.timestamp() if answered and started else None
            results.append((first.time.timestamp() - submitted, scheduler))
            extra = f", sbatch answered → job started {scheduler:.2f} s" if scheduler is not None else ""
            print(f"{executor} run {attempt}: first step {results[-1][0]:.2f} s after submit{extra}", flush=True)
    finally:
        stop_all(processes)
    return results


def job_start(log: Path) -> float | None:
    """When the batch script began: its first line's `date +%s.%N` stamp."""
    for line in log.read_text().splitlines():
        if line.startswith("fathom: job ") and " started at " in line:
            return float(line.rsplit(" started at ", 1)[1])
    return None


def main() -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="fathom-bench-slurm-"))
    logs = data_dir / "bench-logs"
    logs.mkdir()
    os.environ.update(FATHOM_DATA_DIR=str(data_dir), DATABASE_URL=f"sqlite:///{data_dir / 'bench.sqlite3'}")
    for folder in (str(REPO), str(REPO / "platform")):
        sys.path.insert(0, folder)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.contrib.auth import get_user_model
    from django.core.management import call_command
    from rest_framework.authtoken.models import Token

    from tools.slurm_cluster import SlurmCluster

    call_command("migrate", verbosity=0)
    token = Token.objects.create(user=get_user_model().objects.create(username="bench")).key
    cluster = SlurmCluster(state=data_dir / "slurm")
    cluster.start()
    try:
        base = dict(os.environ, OMP_NUM_THREADS="1", FATHOM_JOIN_TOKEN=JOIN_TOKEN, FATHOM_SCHEDULE_INTERVAL="1")
        slurm_env = {**base, **cluster.env(), "FATHOM_EXECUTOR": "slurm", "FATHOM_SLURM_POLL_INTERVAL": "1",
                     "FATHOM_PUBLIC_URL": f"http://127.0.0.1:{free_port()}"}  # fmt: skip
        slurm = measure("slurm", slurm_env, logs, token)
        hosts = measure("hosts", {**base, "FATHOM_PUBLIC_URL": f"http://127.0.0.1:{free_port()}"}, logs, token)
    finally:
        cluster.stop()
    slurm_s = statistics.median(s for s, _ in slurm)
    hosts_s = statistics.median(s for s, _ in hosts)
    scheduler = [s for _, s in slurm if s is not None]
    scheduler_s = statistics.median(scheduler) if scheduler else float("nan")
    print(f"started at {datetime.now():%Y-%m-%d %H:%M}; medians of {REPEATS}; logs in {logs}")
    print(
        f"clock=wall slurm_submit_to_first_step_s={slurm_s:.2f} hosts_submit_to_first_step_s={hosts_s:.2f} "
        f"sbatch_to_job_start_s={scheduler_s:.2f} slurm_minus_hosts_minus_scheduler_s={slurm_s - hosts_s - scheduler_s:.2f}"
    )


if __name__ == "__main__":
    main()
