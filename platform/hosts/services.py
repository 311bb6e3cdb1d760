"""Hosts joining, heartbeating, draining and being lost. Views, admin and tasks call these."""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.exceptions import WrongState
from controlplane.queue import enqueue_on_commit
from hosts.models import Host, running_keys
from hosts.scheduling import orphans_on
from launch.run_agents import send_to_host

log = logging.getLogger(__name__)


class NameTaken(Exception):
    """A join under the name of a host that has its own secret: only that host speaks for it."""


def secret_digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def is_hosts_secret(name: str, secret: str) -> bool:
    """Whether `secret` is the one host `name` was given when it joined."""
    held = Host.objects.filter(name=name).values_list("secret_sha256", flat=True).first()
    return bool(held) and hmac.compare_digest(secret_digest(secret), held or "")


def do_join(name: str, **beat: Any) -> tuple[Host, str]:
    """A heartbeat with the cluster's join token: registers a new host (or one that joined before
    hosts had secrets) and gives it a secret of its own for every later beat. Refuses a name whose
    host has a secret: the join token no longer lets anyone rewrite that host's address."""
    secret = secrets.token_urlsafe(32)
    with transaction.atomic():
        host = do_heartbeat(name, **beat)  # holds the row's lock until this transaction ends
        if host.secret_sha256:
            raise NameTaken(name)  # rolls the beat back
        host.secret_sha256 = secret_digest(secret)
        Host.objects.filter(pk=host.pk).update(secret_sha256=host.secret_sha256)
    log.info("host %s joined and was given its own secret", name)
    return host, secret


def do_remove(host: Host) -> None:
    """Forgets a host holding no device; a machine may then join under its name anew."""
    with transaction.atomic():
        locked = Host.objects.select_for_update().get(pk=host.pk)
        holders = sorted(
            {f"run {c.run_id} node {c.node}" if c.run_id else f"deployment {c.deployment_id} replica {c.node}"
             for c in locked.claims.all()}
        )  # fmt: skip
        if holders:
            raise WrongState(
                "claims",
                f"host {host.name} still holds devices for {', '.join(holders)}: drain it and let that work "
                "end or move first",
            )
        locked.delete()
    log.info("host %s removed", host.name)


def do_heartbeat(
    name: str,
    address: str,
    devices: list[dict[str, Any]],
    labels: dict[str, str],
    running: list[Any],
    cores: int = 0,
    cpu_flags: list[str] | None = None,
) -> Host:
    """Registers the host on its first beat, refreshes it on the next ones. A lost host that
    beats again is ready again; a draining one stays draining until an administrator undrains it."""
    now = timezone.now()
    with transaction.atomic():
        host, created = Host.objects.select_for_update().get_or_create(
            name=name,
            defaults={
                "address": address,
                "devices": devices,
                "labels": labels,
                "running": running,
                "last_seen": now,
                "cores": cores,
                "cpu_flags": cpu_flags or [],
            },
        )
        if created:
            log.info("host %s joined at %s with %d devices", name, address, len(devices))
        else:
            came_back = host.status == Host.Status.LOST
            grew = host.devices != devices or host.address != address
            # An agent or supervisor that exited may leave devices its ended work still held.
            exited = running_keys(host.running) - running_keys(running)
            host.cores, host.cpu_flags = cores, cpu_flags or []
            host.address, host.devices, host.labels, host.running, host.last_seen = (
                address,
                devices,
                labels,
                running,
                now,
            )
            if came_back:
                host.status = Host.Status.READY
                log.info("host %s is back after being lost", name)
            host.save()
            if not (came_back or grew or exited):
                return host
        # New or freed devices: queued runs may fit now.
        enqueue_on_commit("hosts.tasks.schedule_runs")
    return host


def do_drain(host: Host) -> Host:
    """The host keeps what it runs and is given nothing new."""
    if not Host.objects.filter(pk=host.pk, status=Host.Status.READY).update(status=Host.Status.DRAINING):
        raise WrongState("status", f"only a ready host can be drained; this one is {host.status}")
    host.refresh_from_db()
    return host


def do_undrain(host: Host) -> Host:
    with transaction.atomic():
        if not Host.objects.filter(pk=host.pk, status=Host.Status.DRAINING).update(status=Host.Status.READY):
            raise WrongState("status", f"only a draining host can be undrained; this one is {host.status}")
        enqueue_on_commit("hosts.tasks.schedule_runs")
    host.refresh_from_db()
    return host


def do_mark_lost(silent_after: float) -> list[Host]:
    """Marks hosts whose worker has not beaten for `silent_after` seconds as lost; returns them."""
    cutoff = timezone.now() - timedelta(seconds=silent_after)
    lost = []
    for host in Host.objects.exclude(status=Host.Status.LOST).filter(last_seen__lt=cutoff):
        if (
            Host.objects.filter(pk=host.pk, last_seen__lt=cutoff)
            .exclude(status=Host.Status.LOST)
            .update(status=Host.Status.LOST)
        ):
            log.warning("host %s lost: no heartbeat since %s", host.name, host.last_seen)
            host.status = Host.Status.LOST
            lost.append(host)
    return lost


def do_stop_orphans(host: Host) -> list[str]:
    """Has the host stop the supervisors it runs for deployments that hold no device on it (what
    ran on while it was lost, or a start that came after its deployment ended): until they are
    gone, placement gives the host nothing new. Sent on every beat that still lists one."""
    orphans = orphans_on(host)
    for key in orphans:
        log.warning("host %s runs %s, which holds no device there: stopping it", host.name, key)
        send_to_host(host, "stop_process", {"key": key})
    return orphans
