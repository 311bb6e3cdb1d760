"""A deployment's folder: the only reader and writer of its state and event files.

    DEPLOY_DIR/
        deployment.json         the supervisor's DeploymentConfig (options resolved)
        state.json              each replica's url, port, pid, phase, restarts; rewritten atomically
        events.jsonl            one replica lifecycle event per line, appended
        supervisor.log          the supervisor's own output
        logs/replica-<N>.log    vLLM's output, per replica, across restarts
        tmp/, vllm-cache/       the replicas' temporary files and vLLM's cache (serving.vllm)
        metrics.previous.json   the control plane: the counters of its last metrics scrape
        ship-probe              a supervisor that ships its folder (serving.shipper): its token
        shipped.json            the control plane's copy of a shipped folder: what it holds of each file
        hosts/<HOST>/           a deployment placed on hosts: one supervisor per host, each with
                                its own deployment.json … logs/ in this layout

A supervisor on a host writes this layout in the host's own data folder and ships it
(`serving.shipper`): the control plane keeps a copy under hosts/<HOST>/, which is what every
reader here reads.

A deployment's replicas spread over several hosts run under one supervisor per host, each writing
its own folder under hosts/ (its replicas keep the deployment's numbering); `read_state` and
`supervisor_dirs` give readers the deployment as one.

The supervisor writes state and events (`write_state`, `append_event`); the control plane and
the routers read them (`read_state`, `read_events`). Which replicas may take requests is
`DeploymentState.routable()`, the one rule every router and the control plane follow. How much
of each events file the control plane has stored is its own to keep (in the deployment's row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

EventKind = Literal[
    "replica_starting", "replica_ready", "replica_unhealthy", "replica_died", "replica_restarting",
    "replica_failed", "replica_stopped", "replica_adapters",
]  # fmt: skip
# ready: routers may send requests. unhealthy: running but failing /health, routers skip it.
# draining: finishing outstanding requests before stop, routers skip it. failed: it died the
# same way at every start (`replica_failed` says how) and is not started again.
Phase = Literal["starting", "ready", "unhealthy", "draining", "restarting", "failed", "stopped"]


@dataclass(frozen=True)
class DeploymentDir:
    """The paths of one deployment's folder."""

    path: Path

    @property
    def config_file(self) -> Path:
        return self.path / "deployment.json"

    @property
    def state_file(self) -> Path:
        return self.path / "state.json"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def supervisor_log(self) -> Path:
        return self.path / "supervisor.log"

    @property
    def logs_dir(self) -> Path:
        return self.path / "logs"

    def replica_log(self, index: int) -> Path:
        return self.logs_dir / f"replica-{index}.log"

    @property
    def hosts_dir(self) -> Path:
        return self.path / "hosts"

    def on_host(self, host: str) -> DeploymentDir:
        """The folder of the supervisor that runs the deployment's replicas on `host`."""
        return DeploymentDir(self.hosts_dir / host)

    @property
    def probe_file(self) -> Path:
        """The shipper's token: a control plane that reads it in its own copy shares this folder."""
        return self.path / "ship-probe"

    @property
    def shipped_file(self) -> Path:
        """The control plane's ledger of a shipped folder: bytes held of each file it appends."""
        return self.path / "shipped.json"

    @property
    def metrics_previous_file(self) -> Path:
        """The replicas' token counters at the control plane's last scrape (for tokens/s)."""
        return self.path / "metrics.previous.json"


# The files of a supervisor's folder its shipper sends: the state whole, the others appended.
SHIPPED_STATE = "state.json"
SHIPPED_APPENDED = re.compile(r"events\.jsonl|supervisor\.log|logs/replica-\d{1,2}\.log")


@dataclass(frozen=True, kw_only=True)
class ReplicaEvent:
    kind: EventKind
    deployment: str
    replica: int
    at: float
    port: int | None = None
    pid: int | None = None
    restarts: int = 0
    exit_code: int | None = None  # replica_died: the exit status, negative for a signal
    delay_s: float | None = None  # replica_restarting: backoff before the next start
    message: str = ""
    # replica_adapters: the LoRA adapters a running replica loaded and unloaded (by name)
    loaded: list[str] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("loaded", "unloaded"):  # only replica_adapters events say them
            if not data[name]:
                del data[name]
        return data


@dataclass(kw_only=True)
class ReplicaState:
    index: int
    phase: Phase = "starting"
    port: int | None = None
    pid: int | None = None
    url: str | None = None
    restarts: int = 0
    last_exit_code: int | None = None
    log: str = ""
    started_at: float | None = None
    ready_at: float | None = None
    # The LoRA adapters it serves (their model names) besides the deployment's base model.
    adapters: list[str] = field(default_factory=list)


@dataclass(kw_only=True)
class DeploymentState:
    """The content of the state file."""

    deployment: str
    supervisor_pid: int
    updated_at: float
    stopping: bool
    replicas: list[ReplicaState]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeploymentState:
        return cls(
            deployment=data["deployment"],
            supervisor_pid=data["supervisor_pid"],
            updated_at=data["updated_at"],
            stopping=data["stopping"],
            replicas=[ReplicaState(**r) for r in data["replicas"]],
        )

    def routable(self) -> list[ReplicaState]:
        """The replicas that may take requests: ready, with an address, and not being stopped."""
        if self.stopping:
            return []
        return [r for r in self.replicas if r.phase == "ready" and r.url]


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # readers see the old or the new file, never half of one


def write_state(folder: DeploymentDir, state: DeploymentState) -> None:
    write_atomic(folder.state_file, json.dumps(dataclasses.asdict(state), indent=2))


def append_event(folder: DeploymentDir, event: ReplicaEvent) -> None:
    with folder.events_file.open("a") as events:
        events.write(json.dumps(event.to_dict()) + "\n")


def supervisor_dirs(state_dir: str | Path) -> list[DeploymentDir]:
    """The folders of a deployment's supervisors: one per host it was placed on, or its own folder
    (one supervisor on the control plane's machine)."""
    folder = DeploymentDir(Path(state_dir))
    try:
        on_hosts = sorted(p for p in folder.hosts_dir.iterdir() if p.is_dir())
    except FileNotFoundError:
        return [folder]
    return [DeploymentDir(p) for p in on_hosts] or [folder]


def _read_one(folder: DeploymentDir) -> DeploymentState | None:
    try:
        return DeploymentState.from_dict(json.loads(folder.state_file.read_text()))
    except FileNotFoundError:
        return None


def read_state(state_dir: str | Path) -> DeploymentState | None:
    """The last state the deployment's supervisors wrote, as one (replicas in index order), or
    None before any wrote. Of a supervisor's own folder: its state."""
    states = [s for s in map(_read_one, supervisor_dirs(state_dir)) if s is not None]
    if len(states) <= 1:
        return states[0] if states else None
    replicas = []
    for state in states:
        # A supervisor that is stopping drains its replicas: no router may pick them meanwhile.
        replicas += [dataclasses.replace(r, phase="draining") if state.stopping and r.phase == "ready" else r for r in state.replicas]
    return DeploymentState(
        deployment=states[0].deployment,
        supervisor_pid=states[0].supervisor_pid,  # another host's pid: only `request_stop` on one host uses it
        updated_at=min(s.updated_at for s in states),
        stopping=all(s.stopping for s in states),
        replicas=sorted(replicas, key=lambda r: r.index),
    )


def state_files(state_dir: str | Path) -> list[Path]:
    """The state files `read_state` reads: a reader that caches the state re-reads when one changes."""
    return [folder.state_file for folder in supervisor_dirs(state_dir)]


def replica_log(state_dir: str | Path, index: int) -> Path:
    """Replica `index`'s log, in the folder of the supervisor that runs it."""
    logs = [folder.replica_log(index) for folder in supervisor_dirs(state_dir)]
    return next((log for log in logs if log.exists()), logs[0])


def read_events(state_dir: str | Path, offset: int = 0) -> tuple[list[ReplicaEvent], int]:
    """Events written after byte `offset` of the events file, and the offset to pass next time."""
    try:
        with DeploymentDir(Path(state_dir)).events_file.open("rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return [], offset
    complete = data[: data.rfind(b"\n") + 1]  # a line still being written is read next time
    events = [ReplicaEvent(**json.loads(line)) for line in complete.splitlines() if line.strip()]
    return events, offset + len(complete)


def signal_supervisor(state_dir: str | Path, sig: int) -> bool:
    """Sends `sig` to the supervisor whose state file is in `state_dir`. False if none runs."""
    state = read_state(state_dir)
    if state is None:
        return False
    try:
        os.kill(state.supervisor_pid, sig)
    except ProcessLookupError:
        return False
    return True
