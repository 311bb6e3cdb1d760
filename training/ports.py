"""The port a run's rendezvous listens on, chosen before the process that listens has started.

A port from `bind(("", 0))` lies in the kernel's ephemeral range, where every outgoing connection
also takes its local port. Between the pick and the listener's bind (an agent imports torch
first: seconds on a busy machine) a connection can take it, and the store fails with
EADDRINUSE: a CI run saw a Slurm job's agent die so. Rendezvous ports therefore come from a
range below the ephemeral one, which only an explicit bind ever takes; the same range the
scheduler gives runs on hosts (`FATHOM_RENDEZVOUS_PORT_MIN`..`MAX`), so one firewall rule
covers every rendezvous.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

# Below Linux's default ephemeral range (32768-60999); torch's usual 29500 is one of them.
RENDEZVOUS_PORTS = range(29400, 30000)


def listen_port(ports: Sequence[int] = RENDEZVOUS_PORTS, host: str = "127.0.0.1") -> int:
    """A port of `ports` that nothing on `host` holds now, tried in random order (runs that
    start together rarely try the same one first). Raises OSError when every one is taken."""
    for port in random.sample(list(ports), len(ports)):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"every port in {min(ports)}-{max(ports)} is taken on {host or 'this machine'}")


if __name__ == "__main__":  # the Slurm job's first node: python -m training.ports MIN MAX
    import sys

    low, high = int(sys.argv[1]), int(sys.argv[2])
    print(listen_port(range(low, high + 1), host=""))
