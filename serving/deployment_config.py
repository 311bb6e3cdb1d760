"""A deployment's configuration as its supervisor runs it: the export, the model name, the
replicas and their options, ports, cores and timing. The control plane (or a host worker) writes
it into the deployment's folder (`DeploymentDir.config_file`); `python -m serving.supervisor
--config FILE` and the standalone router read it back."""

from __future__ import annotations

import dataclasses
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.routing import DEFAULT_POLICY, POLICIES
from serving.state import DeploymentDir, signal_supervisor, write_atomic
from serving.vllm import OptionError, ReplicaOptions
from training.ports import REPLICA_PORTS

# The most replicas one deployment runs (the API refuses more): one supervisor probes each every
# health interval, and past this many a host's cores go to probing and relaying, not serving.
MAX_REPLICAS = 16


@dataclass(frozen=True, kw_only=True)
class DeploymentConfig:
    """One deployment: which export, under which name, on how many replicas, with what timing."""

    name: str  # the model name clients send (`--served-model-name`)
    # A Hugging Face folder (a checkpoint's export), or an export on object storage
    # (serving.export_store), which the supervisor downloads into this host's cache before any
    # replica starts.
    export: str
    state_dir: str  # this deployment's folder (serving.state.DeploymentDir)
    python: str  # interpreter of the vLLM environment (tools/vllm_env.sh prints it)
    replicas: int = 1
    # LoRA adapters served on the export as their own models: model name → a PEFT adapter folder
    # (`adapter_config.json`, `adapter_model.safetensors`). Replicas start with them; a change
    # reaches running replicas without a restart (`request_adapters`). Needs options.max_loras.
    adapters: dict[str, str] = field(default_factory=dict)
    # How routers choose a replica for a request (serving.routing): by prompt prefix, least
    # loaded, or round robin.
    routing: str = DEFAULT_POLICY
    # The deployment's number of this supervisor's first replica: a deployment spread over hosts
    # runs one supervisor per host, on replicas first_replica … first_replica + replicas - 1.
    first_replica: int = 0
    options: ReplicaOptions = field(default_factory=ReplicaOptions)
    host: str = "127.0.0.1"
    # CPU core lists handed out round-robin (replica i gets cpu_binds[i % len]); empty keeps
    # options.cpu_threads_bind for all, or, started by a host worker, the cores of the slots it
    # claimed. vLLM's "auto" pins every replica to the same first core.
    cpu_binds: tuple[str, ...] = ()
    # The ports (first, last) replicas listen on at `host`, each a free one picked at its start:
    # below the ephemeral range, which outgoing connections take (training.ports).
    ports: tuple[int, int] = (REPLICA_PORTS.start, REPLICA_PORTS.stop - 1)
    # A replica not answering /health by then is killed and restarted. Eager CPU start is ~30 s,
    # a first compiled start ~130 s; GPU starts of large models take minutes.
    ready_timeout_s: float = 600.0
    health_interval_s: float = 2.0
    # Consecutive failed probes of a running replica before routers are told to skip it.
    unhealthy_after: int = 3
    # A replica can answer /health while its engine is stuck (seen on CPU: both replicas stopped
    # generating for minutes, /health still 200). Every liveness_interval_s the supervisor asks
    # for one token; no answer within liveness_timeout_s counts as a failed probe.
    liveness_interval_s: float = 15.0
    liveness_timeout_s: float = 60.0
    # An unhealthy replica is killed (then restarted as after any death) once it has been
    # unhealthy this long: long enough to ride out a pause, short enough to bound an outage.
    restart_unhealthy_after_s: float = 120.0
    # Restart delay: base * 2**(failures in a row), capped. A replica that stayed ready for
    # backoff_reset_s starts over at base.
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    backoff_reset_s: float = 60.0
    # A replica that dies before it is ready this many times in a row with the same last error
    # (the same exit and the same error line in its log: a dtype its kernels refuse, a model its
    # engine cannot load) fails instead of restarting forever; the control plane then fails
    # the deployment with that line. Two tells a bad configuration from one unlucky start.
    failed_starts_to_give_up: int = 2
    # On stop: how long to wait for in-flight requests, then how long SIGTERM gets before SIGKILL.
    drain_timeout_s: float = 30.0
    stop_grace_s: float = 15.0
    # A supervisor that serves a short-lived owner (the quality measurement's Celery task):
    # that process's pid; the supervisor stops its replicas and exits once the owner is gone,
    # however it ended. None: it runs until asked to stop (a deployment's).
    owner_pid: int | None = None
    # A supervisor on a host ships its folder to the control plane (serving.shipper): the
    # endpoint, the deployment's supervisor token for this host, and this host's name. Empty: it ships nothing
    # (on the control plane's machine the folder is already the control plane's).
    ship_url: str = ""
    ship_token: str = ""
    ship_host: str = ""

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise OptionError("name", f"must be a non-empty model name without spaces; got {self.name!r}")
        if not isinstance(self.replicas, int) or not 1 <= self.replicas <= MAX_REPLICAS:
            raise OptionError("replicas", f"must be an integer from 1 to {MAX_REPLICAS}; got {self.replicas!r}")
        if not isinstance(self.failed_starts_to_give_up, int) or self.failed_starts_to_give_up < 1:
            raise OptionError(
                "failed_starts_to_give_up", f"must be a positive integer; got {self.failed_starts_to_give_up!r}"
            )
        if self.owner_pid is not None and (not isinstance(self.owner_pid, int) or self.owner_pid <= 0):
            raise OptionError("owner_pid", f"must be a process id or null; got {self.owner_pid!r}")
        if not isinstance(self.first_replica, int) or not 0 <= self.first_replica < MAX_REPLICAS:
            raise OptionError("first_replica", f"must be an integer from 0 to {MAX_REPLICAS - 1}; got {self.first_replica!r}")
        if isinstance(self.options, dict):
            object.__setattr__(self, "options", ReplicaOptions.from_dict(self.options))
        self._check_adapters()
        if self.routing not in POLICIES:
            raise OptionError("routing", f"must be one of {', '.join(POLICIES)}; got {self.routing!r}")
        object.__setattr__(self, "cpu_binds", tuple(self.cpu_binds))
        ports = tuple(self.ports)
        object.__setattr__(self, "ports", ports)
        if not (len(ports) == 2 and all(_is_port(p) for p in ports) and ports[0] <= ports[1]):
            raise OptionError("ports", f"must be [first, last], ports from 1024 to 65535, first <= last; got {list(ports)!r}")
        for bind in self.cpu_binds:
            dataclasses.replace(self.options, cpu_threads_bind=bind)  # validates the core list
        for name in (
            "ready_timeout_s", "health_interval_s", "restart_backoff_s", "drain_timeout_s", "stop_grace_s",
            "liveness_interval_s", "liveness_timeout_s", "restart_unhealthy_after_s",
        ):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise OptionError(name, f"must be a positive number of seconds; got {value!r}")

    def _check_adapters(self) -> None:
        if not isinstance(self.adapters, dict):
            raise OptionError("adapters", f"must map model names to adapter folders; got {self.adapters!r}")
        for adapter, folder in self.adapters.items():
            if not isinstance(adapter, str) or not adapter or any(c.isspace() for c in adapter) or adapter == self.name:
                raise OptionError(
                    "adapters", f"an adapter's name must be a model name without spaces other than {self.name!r}; got {adapter!r}"
                )
            if not isinstance(folder, str) or not folder:
                raise OptionError("adapters", f"adapter {adapter!r} must name its folder; got {folder!r}")
        if self.adapters and not self.options.max_loras:
            raise OptionError("max_loras", "must be at least 1 for a deployment that serves adapters")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DeploymentConfig:
        if "checkpoint" in data and "export" not in data:  # a config file written before the rename
            data = {("export" if key == "checkpoint" else key): value for key, value in data.items()}
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise OptionError(key, f"is not a deployment field; fields are {', '.join(sorted(known))}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["cpu_binds"] = list(self.cpu_binds)
        data["adapters"] = dict(self.adapters)
        data["ports"] = list(self.ports)
        return data

    def write(self) -> Path:
        """Write the config file into the deployment's folder and return its path."""
        path = DeploymentDir(Path(self.state_dir)).config_file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.to_dict(), indent=2))
        return path


def request_change(state_dir: str | Path, **changes: Any) -> bool:
    """Rewrites the config file of the deployment whose supervisor runs in `state_dir` with
    `changes` (checked as a whole config is) and sends the supervisor SIGHUP, which brings its
    running replicas to the config's `adapters` and `replicas` without restarting the others.
    False when no supervisor runs there (its next start reads the file anyway)."""
    folder = DeploymentDir(Path(state_dir))
    config = DeploymentConfig.from_dict(json.loads(folder.config_file.read_text()))
    changed = DeploymentConfig.from_dict({**config.to_dict(), **changes})
    write_atomic(folder.config_file, json.dumps(changed.to_dict(), indent=2))
    return signal_supervisor(state_dir, signal.SIGHUP)


def _is_port(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 1024 <= value <= 65535


def replica_gpus(visible: str | None, local_index: int, per_replica: int) -> str | None:
    """CUDA_VISIBLE_DEVICES for the supervisor's `local_index`-th replica: its own `per_replica`
    of the GPUs the supervisor was given (the devices its host worker claimed for this
    deployment), in order. None keeps what the supervisor sees: it was given no list to split,
    or too short a one."""
    if not visible:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    mine = devices[local_index * per_replica : (local_index + 1) * per_replica]
    return ",".join(mine) if len(mine) == per_replica else None
