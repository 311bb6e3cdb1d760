"""Ports that a process listens on after it was picked for it: a run's rendezvous store, a
deployment's replicas.

A port from `bind(("", 0))` lies in the kernel's ephemeral range, where every outgoing connection
also takes its local port. Between the pick and the listener's bind (an agent imports torch
first, a vLLM replica loads its model: seconds to minutes on a busy machine) a connection can
take it, and the listener fails with EADDRINUSE: a CI run saw a Slurm job's agent die so. These
ports therefore come from ranges below the ephemeral one, which only an explicit bind ever
takes; rendezvous ports from the range the scheduler gives runs on hosts
(`FATHOM_RENDEZVOUS_PORT_MIN`..`MAX`), replica ports from `FATHOM_REPLICA_PORT_MIN`..`MAX`, and
the port of each attempt's rank 0 store (MASTER_PORT, which the node agent of group rank 0
picks) from `RANK_STORE_PORTS`, so one firewall rule covers each.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Sequence

# Below Linux's default ephemeral range (32768-60999); torch's usual 29500 is one of them.
RENDEZVOUS_PORTS = range(29400, 30000)
# Just below the rendezvous ports: a replica per port on a host.
REPLICA_PORTS = range(28400, 29400)
# Just below the replica ports: rank 0's store (MASTER_PORT) of each attempt of a run.
RANK_STORE_PORTS = range(27400, 28400)


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
