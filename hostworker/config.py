"""The host worker's configuration, from environment variables (and `python -m hostworker` flags)."""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

REPO_DIR = Path(__file__).resolve().parents[1]


def address_towards(url: str) -> str:
    """The local address this machine reaches `url` from: what other hosts reach it at, on the
    same network as the control plane (no packet is sent: a UDP connect only picks the route)."""
    parts = urlsplit(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((parts.hostname or "127.0.0.1", parts.port or 80))
        return str(s.getsockname()[0])


def parse_labels(raw: str) -> dict[str, str]:
    """`zone=a,gpu=h100` → {"zone": "a", "gpu": "h100"}."""
    labels = {}
    for item in raw.split(","):
        if item.strip():
            key, _, value = item.partition("=")
            labels[key.strip()] = value.strip()
    return labels


@dataclass
class HostConfig:
    name: str
    control_url: str  # the control plane's FATHOM_PUBLIC_URL
    join_token: str = field(repr=False)
    address: str
    broker_url: str
    data_dir: Path  # the shared data folder (run folders; the filesystem broker's folders)
    state_dir: Path  # this host's own: what it started (survives a worker restart)
    labels: dict[str, str]
    cpu_slots: int
    heartbeat_s: float
    python: str  # the interpreter that runs agents, stores and supervisors

    @property
    def queue(self) -> str:
        return f"host.{self.name}"

    @classmethod
    def from_env(cls, **overrides: str | None) -> HostConfig:
        env = {**os.environ, **{k: v for k, v in overrides.items() if v is not None}}
        control_url = env.get("FATHOM_PUBLIC_URL", "http://127.0.0.1:8000").rstrip("/")
        name = env.get("FATHOM_HOST_NAME") or socket.gethostname()
        data_dir = Path(env.get("FATHOM_DATA_DIR", str(REPO_DIR / "var"))).resolve()
        return cls(
            name=name,
            control_url=control_url,
            join_token=env.get("FATHOM_JOIN_TOKEN", ""),
            address=env.get("FATHOM_HOST_ADDRESS") or address_towards(control_url),
            broker_url=env.get("CELERY_BROKER_URL") or env.get("REDIS_URL") or "filesystem://",
            data_dir=data_dir,
            state_dir=Path(env.get("FATHOM_HOST_STATE_DIR") or data_dir / "hosts" / name),
            labels=parse_labels(env.get("FATHOM_HOST_LABELS", "")),
            cpu_slots=int(env.get("FATHOM_HOST_CPU_SLOTS") or os.cpu_count() or 1),
            heartbeat_s=float(env.get("FATHOM_HOST_HEARTBEAT_S", "2")),
            python=env.get("FATHOM_TRAINING_PYTHON") or sys.executable,
        )
