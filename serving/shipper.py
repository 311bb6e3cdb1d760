"""Ships a supervisor's folder on a host to the control plane, which keeps a copy in its own
deployment folder (hosts/<HOST>/) that its sync, its routers and the log API read.

A host keeps its supervisor's folder to itself (the control plane's is out of its reach), so the
state, the events and the logs travel over HTTP, as a run's logs do (training.agent.log_shipper):

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

import base64
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from serving.state import SHIPPED_APPENDED, SHIPPED_STATE, DeploymentDir

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024  # per request: a backlog goes in pieces a request can carry


@dataclass(kw_only=True, frozen=True)
class ShipperConfig:
    url: str  # the control plane's endpoint for this deployment
    token: str  # the deployment's supervisor token
    host: str  # this host's name: the control plane keeps its copy under hosts/<host>/
    folder: DeploymentDir  # this supervisor's folder on this host
    # The state's changes reach routers within about this; the supervisor rewrites it every
    # health interval (2 s) anyway, so polling faster buys nothing.
    poll_interval: float = 1.0
    request_timeout: float = 10.0


class FolderShipper:
    def __init__(self, config: ShipperConfig) -> None:
        self.config = config
        self.probe = secrets.token_hex(16)
        self.shared = False
        self.last_error: str | None = None
        self._sent: dict[str, int] = {}  # appended file -> where the control plane's copy ends
        self._state_sent = b""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="folder-shipper", daemon=True)
        self._client = httpx.Client(timeout=config.request_timeout, trust_env=False)

    def start(self) -> None:
        self.config.folder.path.mkdir(parents=True, exist_ok=True)
        self.config.folder.probe_file.write_text(self.probe)
        self._thread.start()

    def close(self, timeout: float) -> bool:
        """Stops polling, then ships what changed since (the final state, the last log lines),
        trying again for up to `timeout` while the control plane does not answer."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout=timeout)
        try:
            while True:
                self.ship_once()
                if self.last_error is None or time.monotonic() >= deadline:
                    return self.last_error is None
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        finally:
            self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval) and not self.shared:
            self.ship_once()

    def files(self) -> list[str]:
        folder = self.config.folder.path
        found = [str(p.relative_to(folder)) for p in (folder / "logs").glob("replica-*.log")]
        return sorted(f for f in ["events.jsonl", "supervisor.log", *found] if SHIPPED_APPENDED.fullmatch(f))

    def ship_once(self) -> None:
        """Sends the state if it changed and what each appended file gained; on an error, tries
        again at the next poll."""
        try:
            if self.shared:
                return
            try:
                state = self.config.folder.state_file.read_bytes()
            except FileNotFoundError:
                state = b""
            if state and state != self._state_sent:
                self._post(SHIPPED_STATE, 0, state)
                self._state_sent = state
            for name in self.files():
                if self.shared:
                    return
                self._ship(name)
            self.last_error = None
        except (OSError, ValueError, KeyError, httpx.HTTPError) as exc:
            if str(exc) != self.last_error:
                logger.warning("shipping %s to %s: %s", self.config.folder.path, self.config.url, exc)
            self.last_error = str(exc)

    def _ship(self, name: str) -> None:
        path = self.config.folder.path / name
        if not path.exists():
            return
        size = path.stat().st_size
        if name not in self._sent:
            self._sent[name] = self._post(name, 0, b"")  # where the control plane's copy ends
        with path.open("rb") as f:
            while not self.shared and self._sent[name] < size:
                at = self._sent[name]
                f.seek(at)
                self._sent[name] = self._post(name, at, f.read(min(CHUNK_BYTES, size - at)))

    def _post(self, name: str, offset: int, data: bytes) -> int:
        body = {
            "host": self.config.host, "probe": self.probe, "file": name, "offset": offset,
            "chunk": base64.b64encode(data).decode(),
        }  # fmt: skip
        response = self._client.post(self.config.url, json=body, headers={"Authorization": f"Bearer {self.config.token}"})
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
        answer = response.json()
        if answer.get("shared"):
            self.shared = True
            return offset
        return int(answer["offset"])


def shipper_for(state_dir: Path, url: str, token: str, host: str) -> FolderShipper | None:
    """The started shipper of a supervisor told where to ship (on a host), else None."""
    if not url:
        return None
    shipper = FolderShipper(ShipperConfig(url=url, token=token, host=host, folder=DeploymentDir(state_dir)))
    shipper.start()
    return shipper
