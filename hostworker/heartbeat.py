"""Registration and heartbeats: the host tells the control plane what it is and what it runs."""

from __future__ import annotations

import json
import logging
import os
import threading
import urllib.error
import urllib.request
from typing import Any

from hostworker.config import HostConfig
from hostworker.devices import cpu_flags, detect
from hostworker.processes import Processes

log = logging.getLogger(__name__)


class JoinRefused(RuntimeError):
    pass


def send(config: HostConfig, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{config.control_url}/api/hosts/heartbeat/",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {config.join_token}"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as exc:
        if exc.code in (400, 401):
            raise JoinRefused(
                f"the control plane refused host {config.name}: {exc.read().decode(errors='replace')}"
            ) from None
        raise


class Heartbeat:
    """Beats every `heartbeat_s` on a thread of its own; a failed beat is logged and retried."""

    def __init__(self, config: HostConfig, processes: Processes) -> None:
        self.config = config
        self.processes = processes
        self.devices = detect(config.cpu_slots)
        self.cpu_flags = cpu_flags()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)

    def body(self) -> dict[str, Any]:
        return {
            "name": self.config.name,
            "address": self.config.address,
            "devices": self.devices,
            "labels": self.config.labels,
            "cores": os.cpu_count() or 1,
            "cpu_flags": self.cpu_flags,
            "running": self.processes.running(),
        }

    def register(self) -> str:
        """The first beat; raises JoinRefused when the control plane turns the host away."""
        status = str(send(self.config, self.body()).get("status", ""))
        log.info("host %s joined %s at %s (%s, %d devices)", self.config.name, self.config.control_url,
                 self.config.address, status, len(self.devices))  # fmt: skip
        return status

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.wait(self.config.heartbeat_s):
            try:
                send(self.config, self.body())
            except JoinRefused as exc:
                log.error("%s", exc)
            except (OSError, ValueError) as exc:
                log.warning("heartbeat to %s failed: %s", self.config.control_url, exc)
