"""Typed readers for environment variables. Settings is the only module that calls them (and
`tools/run_embedded`, which starts Fathom before any settings exist, for its kept secrets).

Each reader fails loudly, naming the variable, when a value is set but malformed: a typo in
production configuration must stop the process, not silently fall back to a default.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
from pathlib import Path

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


class ConfigurationError(RuntimeError):
    pass


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigurationError(f"{name} must be one of {sorted(_TRUE | _FALSE - {''})}; got {raw!r}")


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer; got {raw!r}") from None


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be a number; got {raw!r}") from None


def env_choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    """One of `choices` (compared lower-case, surrounding spaces ignored); unset or empty: `default`."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigurationError(f"{name} must be one of {list(choices)}; got {raw!r}")
    return value


def env_list(name: str, default: list[str]) -> list[str]:
    raw = os.environ.get(name)
    if raw is None:
        return default
    return [item.strip() for item in raw.split(",") if item.strip()]


def env_networks(name: str) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    """Comma-separated networks in CIDR notation ("10.20.0.0/16, fd00:1::/64"; a bare address is
    a network of one). Unset or empty: none. A network with host bits set ("10.0.0.5/8") is
    refused: it is a typo for an address or for a network, and which one matters."""
    networks = []
    for item in env_list(name, []):
        try:
            networks.append(ipaddress.ip_network(item))
        except ValueError as exc:
            raise ConfigurationError(f"{name} must be comma-separated networks such as 10.0.0.0/8; {exc}") from None
    return tuple(networks)


def env_secret(name: str, kept_in: Path, nbytes: int = 32) -> str:
    """The variable's value, or a random secret made once and kept (mode 0600) in `kept_in`, so
    an install without one set keeps the same secret across restarts."""
    if value := os.environ.get(name):
        return value
    if not kept_in.exists():
        kept_in.write_text(secrets.token_urlsafe(nbytes))
        kept_in.chmod(0o600)
    return kept_in.read_text().strip()
