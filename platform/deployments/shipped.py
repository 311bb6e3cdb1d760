"""The control plane's copy of a supervisor's folder on a host, which the supervisor's shipper
(`serving.shipper`) sends: what sync, the routers and the log API read, under hosts/<HOST>/."""

from __future__ import annotations

import hmac
import json

from django.utils.crypto import salted_hmac

from controlplane.exceptions import InvalidInput
from deployments.models import Deployment
from hosts.models import DeviceClaim, Host
from runs.logs import append_past
from serving.state import SHIPPED_APPENDED, SHIPPED_STATE, DeploymentDir, DeploymentState, write_atomic

# What one shipped piece may carry (the shipper sends 256 KiB; this leaves room, bounds a request).
MAX_PIECE_BYTES = 1024 * 1024


def supervisor_token(deployment_id: int, host: str) -> str:
    """The bearer token of the deployment's supervisor on `host`: derived from our secret key, so
    nothing is stored, and neither another deployment's token nor another host's can be made
    from it (no host speaks for another)."""
    return salted_hmac("fathom.deployments.supervisor-token", f"{deployment_id}@{host}").hexdigest()


def deployment_of_token(deployment_id: int, host: str, authorization: str) -> Deployment | None:
    """The deployment whose supervisor token for `host` the Authorization header carries; None
    otherwise."""
    token = authorization.removeprefix("Bearer ").strip() if authorization.startswith("Bearer ") else ""
    if not token or not hmac.compare_digest(token, supervisor_token(deployment_id, host)):
        return None
    return Deployment.objects.filter(pk=deployment_id).first()


def holds_devices(deployment: Deployment, host: str) -> bool:
    """Whether the deployment holds devices on `host`. A supervisor that ran on while its host
    was lost holds none there (its replicas were taken out, and may run elsewhere now): what it
    ships would route requests to a replica that is being stopped, so it is refused."""
    return DeviceClaim.objects.filter(deployment=deployment, host__name=host).exists()


def copy_of(deployment: Deployment, host: str) -> DeploymentDir:
    """Our copy of the folder of `host`'s supervisor; refused for a name no host has."""
    if not Host.objects.filter(name=host).exists():
        raise InvalidInput("host", f"must be the name of a registered host; got {host!r}")
    return DeploymentDir(deployment.folder).on_host(host)


def shared_with_supervisor(copy: DeploymentDir, probe: str) -> bool:
    """Whether the supervisor writes to this very folder: its probe is here."""
    try:
        return copy.probe_file.read_text() == probe
    except (OSError, ValueError):
        return False


def receive(copy: DeploymentDir, name: str, offset: int, data: bytes) -> int:
    """Keeps a shipped piece: the state replaces ours whole (checked first, so a reader never
    meets a state it cannot read), the events and logs get the bytes they lack. Returns where
    our copy of the file ends."""
    if name == SHIPPED_STATE:
        if offset != 0:
            raise InvalidInput("offset", f"must be 0 for {SHIPPED_STATE} (it is sent whole); got {offset}")
        try:
            DeploymentState.from_dict(json.loads(data))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidInput("chunk", f"must be a supervisor's state: {exc}") from None
        copy.path.mkdir(parents=True, exist_ok=True)
        write_atomic(copy.state_file, data.decode())
        return len(data)
    if not SHIPPED_APPENDED.fullmatch(name):
        raise InvalidInput("file", f"must be {SHIPPED_STATE}, events.jsonl, supervisor.log or logs/replica-<N>.log; got {name!r}")
    copy.logs_dir.mkdir(parents=True, exist_ok=True)
    return append_past(copy.shipped_file, copy.path / name, name, offset, data)
