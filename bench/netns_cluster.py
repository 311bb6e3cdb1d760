"""A Fathom cluster of namespace hosts for the benches that need real hosts: each host a host
worker at its own address (tools/netns.py), the web process, a Celery worker with beat and a Redis
broker on the namespaces' bridge, on a fresh PostgreSQL database (`control_plane_on_postgres`,
which also sets Django up in the bench's process: the benches read the database directly).
Needs root and iproute2."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.waiting import answers, free_port, stop_all, wait

REPO = Path(__file__).resolve().parents[1]
JOIN_TOKEN = "bench-join-token"


def control_plane_on_postgres(database: str, data_prefix: str) -> Path:
    """A fresh, migrated PostgreSQL database `database` (on this machine's server) that Django in
    this process and every process a cluster starts use; returns the data folder."""
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {database}")
    os.environ["DATABASE_URL"] = f"postgres://postgres@127.0.0.1:5432/{database}"
    os.environ.setdefault("FATHOM_DATA_DIR", tempfile.mkdtemp(prefix=data_prefix))
    for folder in (str(REPO), str(REPO / "platform")):
        sys.path.insert(0, folder)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return Path(os.environ["FATHOM_DATA_DIR"])


@dataclass
class NetnsCluster:
    url: str
    network: object  # tools.netns.Network
    logs: Path
    env: dict[str, str]
    namespaces: list[str] = field(default_factory=list)
    host_workers: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, name: str, command: list[str], cwd: Path, **extra: str) -> subprocess.Popen[bytes]:
        with (self.logs / f"{name}.log").open("ab") as out:
            process = subprocess.Popen(command, cwd=cwd, env={**self.env, **extra}, stdout=out, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process

    def start_host(self, index: int, cpu_slots: int, core: int | None = None) -> None:
        """(Re)starts host `index`'s worker in its namespace; its state folder (and so its secret)
        is kept across restarts, as a machine's disk would be. `core`: the one core of this
        machine the host has to itself (else its slots start at core 0, as every host's do)."""
        pinned = ["taskset", "-c", str(core)] if core is not None else []
        command = ["ip", "netns", "exec", self.namespaces[index], *pinned, sys.executable, "-m", "hostworker"]
        self.host_workers[index] = self.start(
            f"host{index}", command, REPO, FATHOM_HOST_NAME=f"h{index}", FATHOM_HOST_CPU_SLOTS=str(cpu_slots),
        )  # fmt: skip

    def power_cut(self, index: int) -> int:
        """SIGKILL to everything host `index` runs, at once; returns how many processes."""
        return self.network.kill_everything_in(self.namespaces[index])  # type: ignore[attr-defined]


@contextmanager
def netns_cluster(
    database_url: str, data_dir: Path, hosts: int = 2, cpu_slots: int = 2, core_each: bool = False, **settings: str
) -> Iterator[NetnsCluster]:
    """`hosts` joined and ready; `core_each`: host `index` has core `index` to itself; `settings`
    are more environment for every process (product defaults otherwise)."""
    from controlplane.web import web_command
    from hosts.models import Host
    from tools import netns

    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with netns.network() as net:
        bridge = net.bridge_address
        broker_port = free_port()
        broker = netns.Broker(bridge, broker_port, logs / "redis.log")
        broker.start()
        url = f"http://{bridge}:{free_port()}"
        env = dict(
            os.environ, DATABASE_URL=database_url, FATHOM_DATA_DIR=str(data_dir), OMP_NUM_THREADS="1",
            CELERY_BROKER_URL=f"redis://{bridge}:{broker_port}/0", ALLOWED_HOSTS=bridge,
            FATHOM_JOIN_TOKEN=JOIN_TOKEN, FATHOM_PUBLIC_URL=url, **settings,
        )  # fmt: skip
        cluster = NetnsCluster(url=url, network=net, logs=logs, env=env)
        try:
            cluster.start("web", web_command(int(url.rsplit(":", 1)[1]), bridge), REPO / "platform")
            wait(lambda: answers(f"{url}/login/"), 60, "the web process")
            cluster.start("worker", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-B", "--pool=threads",
                                     "--concurrency=4", "--schedule", str(logs / "beat-schedule"), "--without-gossip",
                                     "--without-mingle", "--without-heartbeat"], REPO / "platform")  # fmt: skip
            for index in range(hosts):
                cluster.namespaces.append(net.add_namespace())
                cluster.start_host(index, cpu_slots, core=index if core_each else None)
            wait(lambda: Host.objects.filter(status="ready").count() == hosts, 120, f"{hosts} ready hosts")
            yield cluster
        finally:
            stop_all(cluster.processes)
            broker.stop()
