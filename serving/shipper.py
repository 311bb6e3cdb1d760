"""Ships a supervisor's folder on a host to the control plane, which keeps a copy in its own
deployment folder (hosts/<HOST>/) that its sync, its routers and the log API read.

A host keeps its supervisor's folder to itself (the control plane's is out of its reach), so the
state, the events and the logs travel over HTTP, as a run's logs do, by the append protocol of
`hostworker.shipper`:

    POST {url}   Authorization: Bearer {token}
    {"host": "h0", "probe": "<token>", "file": "logs/replica-0.log", "offset": 4096, "chunk": "<base64>"}
    -> 200 {"offset": n}     (where the control plane's copy of the file ends: send from there)
    -> 200 {"shared": true}  (the control plane sees this folder itself: nothing needs shipping)

`state.json` goes whole whenever it changed (offset 0; the copy is replaced atomically), the
events and logs as what they gained, kept once however often a piece is sent. The probe is a
token written into the folder: a control plane that reads the same token in its copy shares the
folder (one machine, or a shared data folder), and the shipper stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hostworker.shipper import AppendShipper, Endpoint
from serving.state import SHIPPED_APPENDED, SHIPPED_STATE, DeploymentDir


@dataclass(kw_only=True, frozen=True)
class ShipperConfig:
    url: str  # the control plane's endpoint for this deployment
    token: str  # the deployment's supervisor token for this host
    host: str  # this host's name: the control plane keeps its copy under hosts/<host>/
    folder: DeploymentDir  # this supervisor's folder on this host
    # The state's changes reach routers within about this; the supervisor rewrites it every
    # health interval (2 s) anyway, so polling faster buys nothing.
    poll_interval: float = 1.0
    request_timeout: float = 10.0


class FolderShipper(AppendShipper):
    thread_name = "folder-shipper"

    def __init__(self, config: ShipperConfig) -> None:
        endpoint = Endpoint(
            url=config.url, token=config.token, fields={"host": config.host},
            poll_interval=config.poll_interval, request_timeout=config.request_timeout,
        )  # fmt: skip
        super().__init__(endpoint, config.folder.probe_file)
        self.config = config
        self._state_sent = b""

    def files(self) -> list[tuple[str, Path]]:
        folder = self.config.folder.path
        found = [str(p.relative_to(folder)) for p in (folder / "logs").glob("replica-*.log")]
        names = sorted(f for f in ["events.jsonl", "supervisor.log", *found] if SHIPPED_APPENDED.fullmatch(f))
        return [(name, folder / name) for name in names]

    def ship_whole(self) -> None:
        try:
            state = self.config.folder.state_file.read_bytes()
        except FileNotFoundError:
            return
        if state and state != self._state_sent:
            self.send(SHIPPED_STATE, 0, state)
            self._state_sent = state


def shipper_for(state_dir: Path, url: str, token: str, host: str) -> FolderShipper | None:
    """The started shipper of a supervisor told where to ship (on a host), else None."""
    if not url:
        return None
    shipper = FolderShipper(ShipperConfig(url=url, token=token, host=host, folder=DeploymentDir(state_dir)))
    shipper.start()
    return shipper
