"""The processes a host worker starts for the control plane, by key (`run-7-node-1`).

Each gets a session of its own (it outlives a worker restart) and, for a node agent, runs under
`flock -n` on the agent's lock, so a start delivered twice starts one agent. Their pids are kept
in the host's state folder, so a restarted worker still reports and stops them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import threading
from pathlib import Path, PurePosixPath
from typing import Any

from hostworker.config import REPO_DIR, HostConfig
from hostworker.devices import slot_cores, usable_cores
from hostworker.started_environment import CPU_CORES, HOST_NAME, cores_text

log = logging.getLogger(__name__)

# What the control plane may ask a host to run: nothing else, whatever reaches its queue.
MODULES = ("training.agent", "training.agent.rendezvous_store", "serving.supervisor")

# In a start's args, log and lock: the host's own folder for the process (`start(folder=…)`),
# under this host's data folder. The control plane names paths inside it without knowing where
# the host keeps its data.
FOLDER = "{folder}"


def inside(root: Path, relative: str, what: str) -> Path:
    """`root / relative`, refused unless `relative` is a plain relative path that stays inside."""
    path = PurePosixPath(relative)
    if not relative or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{what} must be a relative path inside {root}; got {relative!r}")
    return root / path


def is_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does not).
    The control plane asks the same of the processes it starts (`controlplane.processes`)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def interface_of(address: str) -> str | None:
    """The network interface holding `address`, for gloo to bind its ranks' sockets to (left to
    itself it resolves the host name, which on a multi-homed machine may be another network)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
                if socket.inet_ntoa(raw[20:24]) == address:
                    return name
    return None


def write_atomically(path: Path, text: str) -> None:
    """A reader (an agent of an earlier launch, a rank restarting) sees the old file or the new one.
    The temporary file is this writer's own: host workers that share a data folder write a run's
    spec into one folder at once (CI saw one's rename take the other's temporary file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class Processes:
    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self.state_file = config.state_dir / "processes.json"
        config.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}

    def _read(self) -> dict[str, dict[str, int]]:
        """{key: {"pid", "launch"}} of what this host started and has not yet seen exit."""
        try:
            return {
                k: {"pid": int(v["pid"]), "launch": int(v["launch"])}
                for k, v in json.loads(self.state_file.read_text()).items()
            }
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return {}

    def _write(self, processes: dict[str, dict[str, int]]) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(processes, sort_keys=True))
        tmp.replace(self.state_file)

    def environment(self, devices: list[int], device_kind: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONPATH=str(REPO_DIR), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        env.pop("FATHOM_JOIN_TOKEN", None)  # the cluster's secret stays with the host worker
        env[HOST_NAME] = self.config.name  # what an agent calls its host in its events
        if device_kind == "gpu":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
        else:
            env["CUDA_VISIBLE_DEVICES"] = ""
            env["FATHOM_CPU_SLOTS"] = ",".join(str(d) for d in devices)
            if devices:
                per_slot = self.slot_cores(devices)
                env[CPU_CORES] = cores_text(per_slot)
                # A rank or replica computes on its slot's cores, unless the operator chose a count.
                env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", str(len(per_slot[0])))
        if not self.config.address.startswith("127.") and (interface := interface_of(self.config.address)):
            # The interface the other hosts reach this one on, for gloo's sockets and NCCL's
            # bootstrap and socket transport; an operator's NCCL choice (an interface facing the
            # GPU fabric, a "^docker" exclusion) stands.
            env["GLOO_SOCKET_IFNAME"] = interface
            env.setdefault("NCCL_SOCKET_IFNAME", interface)
        return env

    def slot_cores(self, slots: list[int]) -> list[list[int]]:
        return slot_cores(slots, self.config.cpu_slots, usable_cores())

    def start(
        self, key: str, module: str, args: list[str], log_path: str, lock: str = "",
        devices: list[int] | None = None, device_kind: str = "cpu", launch: int = 0,
        folder: str = "", files: dict[str, str] | None = None,
    ) -> int | None:  # fmt: skip
        """Starts `python -m module args` for `key` (`launch`: which launch of it); returns its pid.

        `folder` (relative to this host's data folder) is the process's folder on this host:
        `FOLDER` in args, log and lock stands for it, and `files` ({name in it: text}, such as
        a run's spec) are written into it first, so the process reads nothing of the control
        plane's own folder. The same launch delivered twice starts once. A new launch of a key
        whose previous one still runs (a run resumed while its old agent stops) waits up to 90 s
        for the old one's lock instead of giving up at once."""
        if module not in MODULES:
            raise ValueError(f"{module!r} is not a module a host runs ({', '.join(MODULES)})")
        if folder:
            own = str(inside(self.config.data_dir, folder, "folder"))
            args = [arg.replace(FOLDER, own) for arg in args]
            log_path, lock = log_path.replace(FOLDER, own), lock.replace(FOLDER, own)
        with self._lock:
            known = self._read()
            previous = known.get(key)
            replacing = previous is not None and is_alive(previous["pid"])
            if replacing and previous is not None and previous["launch"] == launch:
                log.info("%s launch %d already runs (pid %d)", key, launch, previous["pid"])
                return None
            if folder:
                for name, text in (files or {}).items():
                    write_atomically(inside(Path(own), name, "a file's name"), text)
            command = [self.config.python, "-m", module, *args]
            if lock:
                command = ["flock", *(["-w", "90"] if replacing else ["-n"]), "-E", "75", lock, *command]
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with open(log_path, "ab") as out:
                process = subprocess.Popen(
                    command, cwd=REPO_DIR, env=self.environment(devices or [], device_kind),
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                )  # fmt: skip
            if device_kind == "cpu" and devices:
                # Its CPU slots are its cores: pinned right after exec, long before the interpreter
                # starts threads or children (they inherit it), so two runs never share a core.
                with contextlib.suppress(ProcessLookupError):
                    os.sched_setaffinity(process.pid, {c for cores in self.slot_cores(devices) for c in cores})
            self._children[process.pid] = process
            known[key] = {"pid": process.pid, "launch": launch}
            self._write(known)
        log.info("started %s: %s (pid %d, launch %d)", key, module, process.pid, launch)
        return process.pid

    def stop(self, key: str, sig: int = signal.SIGTERM) -> bool:
        """Signals the process group of `key` (SIGTERM: an agent stops its ranks cleanly)."""
        known = self._read().get(key)
        pid = known["pid"] if known else None
        if pid is None or not is_alive(pid):
            # It has exited already (an agent that saw its run's cancel marker or ended): nothing to stop.
            log.info("stop %s: not running", key)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)
        log.info("stopped %s (pid %d, signal %d)", key, pid, sig)
        return True

    def request_stop(self, folder: str, name: str, reason: str) -> bool:
        """Writes `reason` to the stop request `name` of the run folder `folder` (relative to this
        host's data folder), which the run's ranks look for; False when this host keeps no such folder."""
        run_dir = inside(self.config.data_dir, folder, "folder")
        if not run_dir.is_dir():
            log.info("stop request for %s: no such run folder here", folder)
            return False
        write_atomically(inside(run_dir, name, "a file's name"), reason)
        log.info("stop requested in %s: %s", folder, reason)
        return True

    def running(self) -> list[dict[str, Any]]:
        """What runs now, for the heartbeat; forgets (and reaps) what exited."""
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]
        with self._lock:
            known = self._read()
            alive = {key: value for key, value in known.items() if is_alive(value["pid"])}
            if alive != known:
                self._write(alive)
        return [{"key": key, **value} for key, value in sorted(alive.items())]
