"""Ships the logs in this host's run folder to the control plane, which keeps a copy in its own
run folder for the log API, the live log, the logs download and webhooks.

A host keeps a run's folder to itself (the control plane's is out of its reach), so what its
ranks, its agent and its standbys write under `logs/` travels over HTTP, as events do, by the
append protocol of `hostworker.shipper`:

    POST {logs_url}   Authorization: Bearer {run_token}
    {"address": "10.0.0.5", "node": 0, "probe": "<token>", "file": "rank0.log", "offset": 4096, "chunk": "<base64>"}
    -> 200 {"offset": n}     (where the control plane's copy of this host's file ends: send from there)
    -> 200 {"shared": true}  (the control plane sees this folder itself: nothing needs shipping)

The control plane keeps one copy per host (by its address) and file. The probe goes into this node's folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hostworker.shipper import AppendShipper, Endpoint
from training.run_dir import LOG_NAME, NodeDir


@dataclass(kw_only=True, frozen=True)
class ShipperConfig:
    logs_url: str
    run_token: str
    logs_dir: Path  # this host's `logs/` of the run
    node: NodeDir  # where the probe is written
    node_rank: int
    address: str  # this host's address: the control plane keeps one copy per host and file
    poll_interval: float = 1.0  # a new log line reaches the control plane within about this
    request_timeout: float = 10.0


class LogShipper(AppendShipper):
    thread_name = "log-shipper"

    def __init__(self, config: ShipperConfig) -> None:
        endpoint = Endpoint(
            url=config.logs_url, token=config.run_token, fields={"address": config.address, "node": config.node_rank},
            poll_interval=config.poll_interval, request_timeout=config.request_timeout,
        )  # fmt: skip
        super().__init__(endpoint, config.node.log_probe_file)
        self.config = config

    def files(self) -> list[tuple[str, Path]]:
        found = sorted(self.config.logs_dir.glob("*.log"))
        return [(path.name, path) for path in found if LOG_NAME.fullmatch(path.name)]
