"""Put this folder on the PYTHONPATH of a process a test starts, and its name lookups never leave
the machine: getaddrinfo answers numeric addresses only, and any name "does not resolve" instead
of asking the DNS server (this machine's is not on loopback).

The API fuzz test's web process needs it: webhook URLs with random host names are resolved when
they are saved (controlplane/outbound.py).
"""

from __future__ import annotations

import socket
from typing import Any

_system_getaddrinfo = socket.getaddrinfo


def _getaddrinfo(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0) -> Any:  # noqa: A002
    if host is not None:
        flags |= socket.AI_NUMERICHOST
    return _system_getaddrinfo(host, port, family, type, proto, flags)


socket.getaddrinfo = _getaddrinfo
