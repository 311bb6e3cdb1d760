"""A rendezvous port is chosen before the process that listens on it starts (training/ports.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from training.ports import RENDEZVOUS_PORTS, listen_port

REPO = Path(__file__).resolve().parents[2]


def ephemeral_ports() -> range:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    return range(low, high + 1)


def test_rendezvous_ports_lie_below_the_range_outgoing_connections_take_their_ports_from() -> None:
    assert RENDEZVOUS_PORTS.stop <= ephemeral_ports().start
    assert listen_port() in RENDEZVOUS_PORTS


def test_a_port_something_listens_on_is_passed_over_and_a_full_range_is_an_error_naming_it() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        free = next(p for p in range(20000, 29000) if p != taken and _bindable(p))
        assert {listen_port([taken, free]) for _ in range(20)} == {free}
        with pytest.raises(OSError, match=f"every port in {taken}-{taken} is taken on 127.0.0.1"):
            listen_port([taken])


def test_the_slurm_job_picks_its_port_of_the_range_it_is_given() -> None:
    picked = subprocess.run(
        [sys.executable, "-m", "training.ports", "29500", "29509"], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert int(picked.stdout) in range(29500, 29510)


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
