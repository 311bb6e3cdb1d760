"""Starts and stops a deployment's replica supervisors: one on this machine, as a detached
process, or one on each host that placement gave some of its replicas, as a start task to the
host's queue (the transport a run's agents take, `run_agents.send_to_host`).

The deployment says what to start (`SupervisorRequest`: its replicas, the devices each needs, and
the config its supervisor runs with here or on a host); the executors (`executors.py`) choose
between the two ways. Nothing here records a deployment's status or events: deployments do.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from django.conf import settings

from deployments.models import Deployment
from hosts import replica_placement
from hosts.models import DeviceClaim, Host
from launch.run_agents import HOST_FOLDER, send_to_host
from serving.deployment_config import DeploymentConfig
from serving.state import DeploymentDir
from serving.supervisor import launch_detached, request_stop


@dataclass(frozen=True)
class SupervisorRequest:
    """What a deployment asks of an executor: start `replicas` (consecutive indexes)."""

    deployment: Deployment
    replicas: list[int]
    kind: str  # the devices a replica takes: "gpu" or "cpu"
    per_replica: int  # how many (tensor_parallel_size)
    refusal: Callable[[Host], str | None]  # why a host cannot run these replicas, or None
    # The supervisor's config: for every replica on this machine (None), or for the replicas a
    # host's group holds, with the control plane's endpoint for what it ships.
    configure: Callable[[replica_placement.ReplicaGroup | None], DeploymentConfig]


@dataclass(frozen=True)
class Started:
    pid: int | None = None  # the supervisor started on this machine
    # Each host given replicas: its name, address, devices and replica indexes.
    placed: list[dict[str, Any]] = field(default_factory=list)


class NotPlaced(Exception):
    """No ready host has room for the replicas now; the message says what they need."""


def supervisor_key(deployment: Deployment) -> str:
    """How a host worker names the deployment's supervisor (one per host)."""
    return f"deployment-{deployment.pk}"


def placed_hosts(deployment: Deployment) -> list[Host]:
    """The hosts that run the deployment's replicas; empty when it runs on this machine."""
    return list(Host.objects.filter(claims__deployment=deployment).distinct().order_by("pk"))


def replicas_on_hosts(deployment: Deployment, host: Host | None = None) -> set[int]:
    """The replicas that hold their devices on a host (on `host`, given one)."""
    claims = DeviceClaim.objects.filter(deployment=deployment)
    return set((claims.filter(host=host) if host is not None else claims).values_list("node", flat=True))


def start_here(request: SupervisorRequest) -> Started:
    return Started(pid=launch_detached(request.configure(None), python=sys.executable))


def start_on_hosts(request: SupervisorRequest) -> Started:
    """Claims a device (or `per_replica` of them) on a ready host for each replica and sends each
    host its supervisor's start; raises NotPlaced, with why, when they do not fit now."""
    groups = replica_placement.place_deployment(
        request.deployment.pk, len(request.replicas), request.kind, request.per_replica,
        refusal=request.refusal, first_replica=request.replicas[0],
    )  # fmt: skip
    if isinstance(groups, str):
        raise NotPlaced(groups)
    # Each host keeps its supervisor's folder under its own data folder (where HOST_FOLDER
    # stands) and gets the config with the start; the supervisor ships state, events and logs
    # to the control plane's copy, DEPLOY_DIR/hosts/<host>/, which every reader reads.
    host_dir = DeploymentDir(Path(HOST_FOLDER))
    for group in groups:
        config = dataclasses.replace(request.configure(group), state_dir=HOST_FOLDER)
        copy = DeploymentDir(request.deployment.folder).on_host(group.host.name).path
        send_to_host(group.host, "start_process", {
            "key": supervisor_key(request.deployment), "module": "serving.supervisor",
            "args": ["--config", str(host_dir.config_file), "--state-dir", str(host_dir.path)],
            "log": str(host_dir.supervisor_log), "devices": group.devices, "device_kind": request.kind,
            "folder": str(copy.relative_to(settings.DATA_DIR)),
            "files": {host_dir.config_file.name: json.dumps(config.to_dict(), indent=2)},
        })  # fmt: skip
    placed = [{"host": g.host.name, "address": g.host.address, "devices": g.devices, "replicas": g.replicas} for g in groups]
    return Started(placed=placed)


def stop_on_hosts(deployment: Deployment, hosts: list[Host]) -> None:
    """The stop to each supervisor on `hosts`: their pids are other machines', each host worker
    signals its own (a lost host runs nothing). Sent even before any state came: a supervisor may
    still be fetching the export."""
    for host in hosts:
        if host.status != Host.Status.LOST:
            send_to_host(host, "stop_process", {"key": supervisor_key(deployment)})


def stop_here(deployment: Deployment) -> bool:
    """The stop to the supervisor on this machine; False when none runs."""
    return request_stop(deployment.folder)
