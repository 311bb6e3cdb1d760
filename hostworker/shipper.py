"""Ships files a host keeps to itself to the control plane, which keeps a copy in its own folder.

A host's run folder (its node agent's logs) and a supervisor's folder (state, events, logs) are
out of the control plane's reach, so what they gain travels over HTTP, one endpoint per kind:

    POST {url}   Authorization: Bearer {token}
    {**fields, "probe": "<token>", "file": "<name>", "offset": 4096, "chunk": "<base64>"}
    -> 200 {"offset": n}     (where the control plane's copy of the file ends: send from there)
    -> 200 {"shared": true}  (the control plane sees this folder itself: nothing needs shipping)

`fields` are the endpoint's own (a run's logs: host and node; a deployment's folder: host). The
control plane appends only the bytes past what it holds, so a chunk sent twice (a lost answer,
two shippers of one host, a shipper started again) is kept once; the first request for a file
sends no bytes and learns where the copy ends. The probe is a token the shipper writes into its
folder: a control plane that reads the same token there shares the folder (one machine), and the
shipper stops. It polls (a second late is fine) and bounds a request to CHUNK_BYTES.

Used by `training.agent.log_shipper` and `serving.shipper`, which say which files go and what
else: stdlib only, so that either side imports it without the other's dependencies (or celery).
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

CHUNK_BYTES = 256 * 1024  # per request: a long outage's backlog goes in pieces a request can carry


@dataclass(kw_only=True, frozen=True)
class Endpoint:
    url: str  # the control plane's endpoint for these files
    token: str  # sent as `Authorization: Bearer`
    fields: Mapping[str, object] = field(default_factory=dict)  # the endpoint's own, in every body
    poll_interval: float = 1.0  # what the files gain reaches the control plane within about this
    request_timeout: float = 10.0


class AppendShipper:
    """Polls the files `files()` names (relative name → path) and sends what each gained.

    A subclass says which files, and may send others whole in `ship_whole()` (with `send`).
    One thread polls; `close()` ships the rest from the caller's thread once that one is done,
    so one connection is never used by two threads."""

    thread_name = "shipper"

    def __init__(self, endpoint: Endpoint, probe_file: Path) -> None:
        self.endpoint = endpoint
        self.probe_file = probe_file
        self.probe = secrets.token_hex(16)
        self.shared = False  # the control plane sees this folder: nothing to ship
        self.last_error: str | None = None
        self._sent: dict[str, int] = {}  # file name -> where the control plane's copy ends
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._url = urllib.parse.urlsplit(endpoint.url)
        self._connection: http.client.HTTPConnection | None = None

    def files(self) -> list[tuple[str, Path]]:
        """The appended files to ship now, by the name the endpoint knows them by."""
        raise NotImplementedError

    def ship_whole(self) -> None:
        """Sends the files that go whole (none unless a subclass has some); called first."""

    def start(self) -> None:
        self.probe_file.parent.mkdir(parents=True, exist_ok=True)
        self.probe_file.write_text(self.probe)
        self._thread.start()

    def close(self, timeout: float) -> bool:
        """Stops polling, then ships what the files gained since (the last lines), trying again
        for up to `timeout` while the control plane does not answer; True once all went."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if self._thread.is_alive():  # stuck in a request: its connection is not ours to use
            return False
        try:
            while True:
                self.ship_once()
                if self.last_error is None or time.monotonic() >= deadline:
                    return self.last_error is None
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))
        finally:
            self._disconnect()

    def _run(self) -> None:
        while not self._stop.wait(self.endpoint.poll_interval) and not self.shared:
            self.ship_once()

    def ship_once(self) -> None:
        """Sends what changed; on an error, tries again at the next poll."""
        try:
            if self.shared:
                return
            self.ship_whole()
            for name, path in self.files():
                if self.shared:
                    return
                self._ship(name, path)
            self.last_error = None
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            self._disconnect()
            if str(exc) != self.last_error:
                logger.warning("shipping %s to %s: %s", self.probe_file.parent, self.endpoint.url, exc)
            self.last_error = str(exc)

    def _ship(self, name: str, path: Path) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:  # not written yet
            return
        if name not in self._sent:
            self._sent[name] = self.send(name, 0, b"")  # where the control plane's copy ends
        with path.open("rb") as f:
            while not self.shared and self._sent[name] < size:
                at = self._sent[name]
                f.seek(at)
                self._sent[name] = self.send(name, at, f.read(min(CHUNK_BYTES, size - at)))

    def send(self, name: str, offset: int, data: bytes) -> int:
        """Sends `data` as the bytes of `name` from `offset`; where the control plane's copy ends
        (`offset` once it answered that it shares the folder, and `shared` is set)."""
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
        body = {
            **self.endpoint.fields, "probe": self.probe, "file": name, "offset": offset,
            "chunk": base64.b64encode(data).decode(),
        }  # fmt: skip
        if self._connection is None:
            kind = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
            self._connection = kind(self._url.netloc, timeout=self.endpoint.request_timeout)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.endpoint.token}"}
        path = self._url.path or "/"
        if self._url.query:
            path += "?" + self._url.query
        self._connection.request("POST", path, body=json.dumps(body).encode(), headers=headers)
        response = self._connection.getresponse()
        payload = response.read()
        if response.status != 200:
            raise ValueError(f"HTTP {response.status}: {payload[:200].decode(errors='replace')}")
        answer = json.loads(payload)
        if answer.get("shared"):
            self.shared = True
            return offset
        return int(answer["offset"])
