"""Ports for the servers a test starts (web processes, brokers, routers, rendezvous stores)."""

from __future__ import annotations

from training.ports import RANK_STORE_PORTS, listen_port


def free_port() -> int:
    """Free now, and below the kernel's ephemeral range, so no connection of the busy suite takes
    it before the server binds it (training/ports.py); below the product's replica and
    rendezvous ranges too, which the deployments and runs a test starts take."""
    return listen_port(range(20000, RANK_STORE_PORTS.start))
