"""Registration and heartbeats: the host tells the control plane what it is and what it runs."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from hostworker.config import HostConfig
from hostworker.devices import cpu_flags, detect
from hostworker.processes import Processes

log = logging.getLogger(__name__)


class JoinRefused(RuntimeError):
    pass


def secret_file(config: HostConfig) -> Path:
    """The secret the control plane gave this host when it joined, kept with the host's own state."""
    return config.state_dir / "host_secret"


def send(config: HostConfig, body: dict[str, Any]) -> dict[str, Any]:
    """One beat, with the host's own secret once it has one, else the cluster's join token (a
    join, whose answer carries the secret, kept for every later beat). A secret the control plane
    no longer knows (staff removed the host) is dropped, and the host joins again at once."""
    kept = secret_file(config)
    secret = kept.read_text().strip() if kept.exists() else ""
    try:
        answer = _post(config, body, secret or config.join_token)
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        if exc.code == 401 and secret:
            log.warning("host %s: the control plane no longer knows its secret; joining again", config.name)
            kept.unlink(missing_ok=True)
            return send(config, body)
        if exc.code in (400, 401, 403):
            raise JoinRefused(f"the control plane refused host {config.name}: {detail}") from None
        raise
    if "host_secret" in answer:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp = kept.with_name(kept.name + ".tmp")
        tmp.unlink(missing_ok=True)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:  # the owner's only
            f.write(str(answer.pop("host_secret")))
        tmp.replace(kept)
    return answer


def _post(config: HostConfig, body: dict[str, Any], token: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{config.control_url}/api/hosts/heartbeat/",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return dict(json.loads(answer.read()))


# How often the heartbeat thread looks at what the host runs between beats.
CHANGE_CHECK_S = 0.2


class Heartbeat:
    """Beats every `heartbeat_s` on a thread of its own, and at once when what the host runs
    changes: the control plane gives a device back only when a beat no longer lists the agent or
    supervisor that held it, so a preempted or finished run's devices go to the next run within
    a check, not a beat interval. A failed beat is logged and retried."""

    def __init__(self, config: HostConfig, processes: Processes) -> None:
        self.config = config
        self.processes = processes
        self.devices = detect(config.cpu_slots)
        self.cpu_flags = cpu_flags()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="heartbeat", daemon=True)
        self._sent_running: list[dict[str, Any]] | None = None  # what the last beat said runs

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
        body = self.body()
        status = str(send(self.config, body).get("status", ""))
        self._sent_running = body["running"]
        log.info("host %s joined %s at %s (%s, %d devices)", self.config.name, self.config.control_url,
                 self.config.address, status, len(self.devices))  # fmt: skip
        return status

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        due = time.monotonic() + self.config.heartbeat_s
        while not self._stop.wait(min(CHANGE_CHECK_S, self.config.heartbeat_s)):
            body = self.body()
            if time.monotonic() < due and body["running"] == self._sent_running:
                continue
            due = time.monotonic() + self.config.heartbeat_s
            try:
                send(self.config, body)
                self._sent_running = body["running"]
            except JoinRefused as exc:
                log.error("%s", exc)
            except (OSError, ValueError) as exc:
                log.warning("heartbeat to %s failed: %s", self.config.control_url, exc)
