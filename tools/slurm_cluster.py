"""A one-machine Slurm cluster for tests and benches: munge, slurmctld and one slurmd.

    python -m tools.slurm_cluster start [--state DIR]   # prints the SLURM_CONF to export
    python -m tools.slurm_cluster stop  [--state DIR]

Debian's `slurm-wlm` and `munge` are installed with apt-get when `slurmctld` is missing. The
cluster's configuration, state, spool, logs and pid files live in DIR (default
`/tmp/fathom-slurm`), so it touches no system Slurm configuration: clients find it through
`SLURM_CONF` (`SlurmCluster.env()`). One node, named after this host's short name, at
127.0.0.1, with this machine's cores (or `cpus`), one partition `debug`, no accounting (so
`sacct` has nothing; the control plane then reads `squeue` and `scontrol`).

`start()` is idempotent: daemons whose pid files name live processes are kept (a cluster a
previous test session left is reused). `stop()` cancels the cluster's jobs, then ends the two
Slurm daemons by their pid files; munged is shared with anything else on the machine that uses
munge, and is left running.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_STATE = Path("/tmp/fathom-slurm")
PARTITION = "debug"
# The daemons answered within ~2 s on a quiet 2-core host; under a busy CI, allow far more.
START_TIMEOUT_S = 60.0
MUNGE_DIRS = ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install_if_missing() -> None:
    """apt-get install slurm-wlm and munge when their daemons are not on this machine, one
    process at a time (apt-get exits 100 while another holds dpkg's lock). An install that fails
    is tried once more after `apt-get update`, for a machine whose package lists are stale."""
    with open("/tmp/fathom-slurm-install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shutil.which("slurmctld") and shutil.which("munged"):
            return
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        install = ["apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge"]
        if subprocess.run(install, env=env).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
            subprocess.run(install, check=True, env=env)


def start_munge() -> None:
    """munged, as the `munge` user, unless a credential already round-trips."""
    if _munge_works():
        return
    for folder in MUNGE_DIRS:
        Path(folder).mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        subprocess.run(["mungekey", "--create"], check=True)
        shutil.chown(key, "munge", "munge")
    # munged exits 1 when another process started one a moment before (the socket's lock is
    # taken): what counts is that a credential round-trips after it.
    started = subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", "munged"], capture_output=True, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _munge_works():
        if time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start ({started.stderr.strip()}); see /var/log/munge/munged.log")
        time.sleep(0.2)


def _munge_works() -> bool:
    try:
        credential = subprocess.run(["munge", "-n"], capture_output=True, check=True, timeout=10).stdout
        subprocess.run(["unmunge"], input=credential, capture_output=True, check=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return True


@dataclass
class SlurmCluster:
    state: Path = DEFAULT_STATE
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])

    @property
    def conf(self) -> Path:
        return self.state / "slurm.conf"

    def env(self) -> dict[str, str]:
        """What a Slurm client (sbatch, squeue, …) needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _pid_file(self, daemon: str) -> Path:
        return self.state / f"{daemon}.pid"

    def _running(self, daemon: str) -> bool:
        pid = _read_pid(self._pid_file(daemon))
        return pid is not None and _alive(pid)

    def _write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.state / sub).mkdir(parents=True, exist_ok=True)
        ctld_port, slurmd_port = _free_port(), _free_port()
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=fathom",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={ctld_port}",
                    f"SlurmdPort={slurmd_port}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    "MpiDefault=none",
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_Core",
                    "SchedulerType=sched/backfill",
                    "AccountingStorageType=accounting_storage/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "JobCompType=jobcomp/none",
                    "ReturnToService=2",
                    # Slurm's defaults (300 s, 30 s) are for real clusters; a test waits on them.
                    "MinJobAge=60",
                    "KillWait=10",
                    "SchedulerParameters=sched_interval=2",
                    f"StateSaveLocation={self.state / 'state'}",
                    f"SlurmdSpoolDir={self.state / 'spool'}",
                    f"SlurmctldPidFile={self._pid_file('slurmctld')}",
                    f"SlurmdPidFile={self._pid_file('slurmd')}",
                    f"SlurmctldLogFile={self.state / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={self.state / 'log' / 'slurmd.log'}",
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
                    f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
                    "",
                ]
            )
        )

    def start(self) -> None:
        """Installs what is missing and starts whatever daemon is not running; returns once the
        node is idle (or allocated: a reused cluster may be running jobs)."""
        install_if_missing()
        start_munge()
        if not (self._running("slurmctld") and self._running("slurmd") and self.conf.exists()):
            self.stop()
            self._write_conf()
            env = dict(os.environ, **self.env())
            subprocess.run(["slurmctld", "-f", str(self.conf), "-c"], check=True, env=env)
            subprocess.run(["slurmd", "-f", str(self.conf), "-N", self.node], check=True, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while (state := self.node_state()) not in ("idle", "mixed", "allocated"):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is {state or 'not answering'}; see {self.state / 'log'}")
            time.sleep(0.3)

    def node_state(self) -> str:
        try:
            out = subprocess.run(
                ["sinfo", "-h", "-n", self.node, "-o", "%T"], capture_output=True, text=True, timeout=10,
                env=dict(os.environ, **self.env()),
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ""
        return out.stdout.strip().rstrip("*~#") if out.returncode == 0 else ""

    def stop(self) -> None:
        """Cancels the cluster's jobs (a job's slurmstepd outlives slurmd), then ends slurmd and
        slurmctld by pid file."""
        if self._running("slurmctld"):
            env = dict(os.environ, **self.env())
            try:
                subprocess.run(["scancel", f"--user={os.getuid()}"], env=env, capture_output=True, timeout=10)
                deadline = time.monotonic() + 30  # KillWait (10 s) and the steps' exit
                while time.monotonic() < deadline:
                    queue = subprocess.run(["squeue", "--noheader"], env=env, capture_output=True, text=True, timeout=10)
                    if queue.returncode != 0 or not queue.stdout.strip():
                        break
                    time.sleep(0.5)
            except (OSError, subprocess.SubprocessError):
                pass  # the daemons are stopped regardless
        for daemon in ("slurmd", "slurmctld"):
            pid = _read_pid(self._pid_file(daemon))
            if pid is None or not _alive(pid):
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.slurm_cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("start", "stop"))
    parser.add_argument("--state", type=Path, default=DEFAULT_STATE, help="configuration, state and logs")
    args = parser.parse_args(argv)
    cluster = SlurmCluster(state=args.state)
    if args.action == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
