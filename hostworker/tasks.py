"""What the control plane asks of a host (sent by name to `host.<name>`, never imported by it)."""

from __future__ import annotations

from hostworker.app import app, config
from hostworker.processes import Processes

processes = Processes(config)


@app.task(name="hostworker.tasks.start_process")
def start_process(
    key: str, module: str, args: list[str], log: str, lock: str = "",
    devices: list[int] | None = None, device_kind: str = "cpu", launch: int = 0,
    folder: str = "", files: dict[str, str] | None = None,
) -> int | None:  # fmt: skip
    """Starts a node agent, a rendezvous store or a replica supervisor by module, detached;
    `folder` and `files`: its folder on this host and what to write there first (`Processes.start`)."""
    return processes.start(
        key, module, args, log, lock=lock, devices=devices, device_kind=device_kind, launch=launch,
        folder=folder, files=files,
    )  # fmt: skip


@app.task(name="hostworker.tasks.stop_process")
def stop_process(key: str) -> bool:
    """SIGTERM to the process group of `key`: an agent cancels its ranks, a supervisor its replicas."""
    return processes.stop(key)


@app.task(name="hostworker.tasks.request_stop")
def request_stop(folder: str, name: str, reason: str) -> bool:
    """Asks the ranks of the run whose folder on this host is `folder` to checkpoint the step
    they agree on and stop (a preemption): its stop request `name`, which they look for every step."""
    return processes.request_stop(folder, name, reason)
