"""Hosts joining, heartbeating, draining and being lost. Views, admin and tasks call these."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.exceptions import WrongState
from controlplane.queue import enqueue_on_commit
from hosts.models import Host

log = logging.getLogger(__name__)


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
            if not (came_back or grew):
                return host
        # New devices: queued runs may fit now.
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
