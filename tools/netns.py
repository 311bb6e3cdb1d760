"""Hosts as network namespaces on one machine, for tests and benches (root and iproute2).

A bridge at <prefix>.1, namespaces at <prefix>.11, .12, … joined to it by
veth pairs, and a Redis broker on the bridge. Callers send traffic only to loopback and to these
addresses and tear everything down at the end (`Network.teardown` also ends every process left in
the namespaces): /work/shared/TORCH-ON-CPU.md, "Several hosts on one machine".
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class Network:
    """A bridge at <prefix>.1 and namespaces at <prefix>.11, .12, …"""

    prefix: str
    bridge: str
    namespaces: list[str] = field(default_factory=list)

    @property
    def bridge_address(self) -> str:
        return f"{self.prefix}.1"

    def address(self, index: int) -> str:
        return f"{self.prefix}.{11 + index}"

    def veth(self, index: int) -> str:
        """The bridge's end of namespace `index`'s link."""
        return f"fv{index}{self.bridge[-3:]}"

    def add_namespace(self) -> str:
        index = len(self.namespaces)
        name, veth = f"fathom-h{index}-{self.bridge[-3:]}", self.veth(index)
        ip("netns", "add", name)
        self.namespaces.append(name)
        ip("link", "add", veth, "type", "veth", "peer", "name", f"{veth}p")
        ip("link", "set", f"{veth}p", "netns", name)
        ip("link", "set", veth, "master", self.bridge)
        ip("link", "set", veth, "up")
        ip("netns", "exec", name, "ip", "addr", "add", f"{self.address(index)}/24", "dev", f"{veth}p")
        ip("netns", "exec", name, "ip", "link", "set", f"{veth}p", "up")
        ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        return name

    def pids_in(self, name: str) -> list[int]:
        """The processes in namespace `name`."""
        listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout
        return [int(pid) for pid in listed.split()]

    def commands_in(self, name: str) -> dict[int, list[str]]:
        """The command line of each process in namespace `name` (those that end meanwhile left out)."""
        commands = {}
        for pid in self.pids_in(name):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            commands[pid] = [arg for arg in argv if arg]
        return commands

    def kill_everything_in(self, name: str) -> int:
        """SIGKILL to every process in namespace `name` (agents and ranks run in sessions of
        their own, so stopping the host worker does not end them); returns how many."""
        pids = self.pids_in(name)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)

    def teardown(self) -> None:
        for index, name in enumerate(self.namespaces):
            self.kill_everything_in(name)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            # A namespace lives on while a killed process is still on its way out, and its link
            # with it: the next network's namespace of the same index could not be linked (CI).
            # Deleting the bridge's end removes the pair at once.
            subprocess.run(["ip", "link", "del", self.veth(index)], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def unused_prefix() -> str:
    """A 10.77.X /24 that no interface of this machine has an address in."""
    used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True, timeout=30).stdout
    for third in range(100, 200):
        if f" 10.77.{third}." not in used:
            return f"10.77.{third}"
    raise RuntimeError("no free 10.77.X.0/24 for the test network")


def hiding(folder: Path) -> list[str]:
    """A command prefix that runs the command in a mount namespace of its own, where `folder`
    is an empty private tmpfs: a host that cannot see the control plane's data folder, as a
    real machine could not (namespaces otherwise share the machine's filesystem). What the
    command starts inherits the namespace; nothing mounted there reaches the machine's."""
    script = 'mount -t tmpfs -o size=1m,mode=0755 fathom-hidden "$0" && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(folder)]


def sees(pid: int, path: Path) -> bool:
    """Whether `path` exists as process `pid` sees the filesystem (its mount namespace)."""
    found = subprocess.run(["nsenter", "-t", str(pid), "-m", "test", "-e", str(path)], timeout=30)
    return found.returncode == 0


@contextmanager
def network() -> Iterator[Network]:
    """A bridge on a /24 no interface uses; removed with its namespaces on the way out."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise RuntimeError("network namespaces need root and iproute2")
    prefix = unused_prefix()
    net = Network(prefix, f"fbr{prefix.rsplit('.', 1)[1]}")
    try:
        ip("link", "add", net.bridge, "type", "bridge")
        ip("addr", "add", f"{net.bridge_address}/24", "dev", net.bridge)
        ip("link", "set", net.bridge, "up")
        yield net
    finally:
        net.teardown()


class Broker:
    """A Redis that keeps nothing on disk, on the bridge only: restarting it loses what it held."""

    def __init__(self, address: str, port: int, log: Path) -> None:
        self.command = ["redis-server", "--bind", address, "--port", str(port), "--save", "", "--appendonly", "no",
                        "--protected-mode", "no"]  # fmt: skip
        self.log = log
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()
