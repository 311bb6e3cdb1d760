"""Ships the logs in this host's run folder to the control plane, which keeps a copy in its own
run folder for the log API, the live log, the logs download and webhooks.

A host keeps a run's folder to itself (the control plane's is out of its reach), so what its
ranks, its agent and its standbys write under `logs/` travels over HTTP, as events do:

    POST {logs_url}   Authorization: Bearer {run_token}
    {"host": "10.0.0.5", "node": 0, "probe": "<token>", "file": "rank0.log", "offset": 4096, "chunk": "<base64>"}
    -> 200 {"offset": n}     (where the control plane's copy of this host's file ends: send from there)
    -> 200 {"shared": true}  (the control plane sees this folder itself: nothing needs shipping)

The control plane appends only the bytes past what it holds of this host's file, so a chunk
sent twice (a lost answer, two agents of one host, an agent started again) is kept once. The
probe is a token this shipper writes into its node's folder: a control plane that reads the same
token there shares the folder (one machine), and the shipper stops. It polls (logs are for
people, a second late is fine) and bounds a request to CHUNK_BYTES.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import secrets
import threading
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from training.run_dir import LOG_NAME, NodeDir

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024  # per request: a long outage's backlog goes in pieces a request can carry


@dataclass(kw_only=True, frozen=True)
class ShipperConfig:
    logs_url: str
    run_token: str
    logs_dir: Path  # this host's `logs/` of the run
    node: NodeDir  # where the probe is written
    node_rank: int
    host: str  # this host's address: the control plane keeps one copy per host and file
    poll_interval: float = 1.0  # a new log line reaches the control plane within about this
    request_timeout: float = 10.0


class LogShipper:
    def __init__(self, config: ShipperConfig) -> None:
        self.config = config
        self.probe = secrets.token_hex(16)
        self.shared = False  # the control plane sees this folder: nothing to ship
        self.last_error: str | None = None
        self._sent: dict[str, int] = {}  # file name -> where the control plane's copy ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._connection: http.client.HTTPConnection | None = None

    def start(self) -> None:
        self.config.node.path.mkdir(parents=True, exist_ok=True)
        self.config.node.log_probe_file.write_text(self.probe)
        self._thread.start()

    def close(self, timeout: float) -> bool:
        """Stops polling, then ships what the logs gained since (the agent's last lines), trying
        again for up to `timeout` while the control plane does not answer; True once all went."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            return False
        while True:
            self.ship_once()
            if self.last_error is None or time.monotonic() >= deadline:
                return self.last_error is None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _run(self) -> None:
        while not self._stop.wait(self.config.poll_interval) and not self.shared:
            self.ship_once()

    def ship_once(self) -> None:
        """Sends what each log file gained; on an error, tries again at the next poll."""
        try:
            for path in sorted(self.config.logs_dir.glob("*.log")):
                if self.shared:
                    return
                if LOG_NAME.fullmatch(path.name):
                    self._ship(path)
            self.last_error = None
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            self._disconnect()
            if str(exc) != self.last_error:
                logger.warning("shipping logs to %s: %s", self.config.logs_url, exc)
            self.last_error = str(exc)

    def _ship(self, path: Path) -> None:
        size = path.stat().st_size
        if path.name not in self._sent:
            self._sent[path.name] = self._post(path.name, 0, b"")  # where the control plane's copy ends
        with path.open("rb") as f:
            while not self.shared and self._sent[path.name] < size:
                at = self._sent[path.name]
                f.seek(at)
                self._sent[path.name] = self._post(path.name, at, f.read(min(CHUNK_BYTES, size - at)))

    def _post(self, name: str, offset: int, data: bytes) -> int:
        try:
            return self._request(name, offset, data)
        except (ConnectionError, http.client.RemoteDisconnected):
            # The server closed the kept-alive connection while it idled: once more, on a new one.
            self._disconnect()
            return self._request(name, offset, data)

    def _disconnect(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _request(self, name: str, offset: int, data: bytes) -> int:
        body = json.dumps({
            "host": self.config.host, "node": self.config.node_rank, "probe": self.probe,
            "file": name, "offset": offset, "chunk": base64.b64encode(data).decode(),
        }).encode()  # fmt: skip
        url = urllib.parse.urlsplit(self.config.logs_url)
        if self._connection is None:
            kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
            self._connection = kind(url.netloc, timeout=self.config.request_timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.config.run_token}"}
        self._connection.request("POST", url.path or "/", body=body, headers=headers)
        response = self._connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {payload[:200].decode(errors='replace')}")
        answer = json.loads(payload)
        if answer.get("shared"):
            self.shared = True
            return offset
        return int(answer["offset"])

