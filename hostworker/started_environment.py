"""What Fathom tells the processes it starts on a machine (a node agent, a replica supervisor)
through their environment: written by the host worker (`hostworker.processes`) or inherited from
the control plane's worker, and read here, each variable parsed in this one place.

Stdlib only: the node agent and the supervisor take this module and `hostworker.shipper` of the
host worker, and nothing else. A rank hears from its agent alone (`training.rank_environment`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HOST_NAME = "FATHOM_HOST_NAME"  # the host worker's name for its machine
CPU_CORES = "FATHOM_CPU_CORES"  # the cores of each CPU slot claimed for the process: "0,1;2,3"
DATA_DIR = "FATHOM_DATA_DIR"  # the machine's own data folder (the host worker's, or the control plane's)


def cores_text(per_slot: list[list[int]]) -> str:
    """FATHOM_CPU_CORES: the cores of each claimed slot, in claim order ("0,1;2,3"), which a node
    agent gives its local ranks and a replica supervisor its replicas, one slot each."""
    return ";".join(",".join(map(str, cores)) for cores in per_slot)


@dataclass(frozen=True)
class StartedEnvironment:
    host_name: str  # what an agent calls its host in its events: the host worker's name, else the machine's
    # The cores of each CPU slot claimed for the process, in claim order; empty where none were
    # (a GPU host, or no host worker).
    slot_cores: tuple[frozenset[int], ...]
    data_dir: Path | None  # None: started by hand, with no data folder of its machine's

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> StartedEnvironment:
        env = os.environ if environ is None else environ
        slots = env.get(CPU_CORES, "")
        return cls(
            host_name=env.get(HOST_NAME) or socket.gethostname(),
            slot_cores=tuple(frozenset(int(c) for c in part.split(",")) for part in slots.split(";") if part),
            data_dir=Path(env[DATA_DIR]) if env.get(DATA_DIR) else None,
        )

    def cache_root(self, default: Path) -> Path:
        """Where this machine keeps what its processes download from object storage (datasets,
        exports), checked once and shared by its runs and deployments: its data folder's cache,
        else `default`."""
        return self.data_dir / "cache" if self.data_dir is not None else default
