"""`python manage.py stop_work [--wait S]`: stops every run and deployment, as `make run`'s
Ctrl-C does before it stops the web, worker and host processes.

Runs are cancelled (each keeps its last checkpoint and can be resumed) and deployments stopped
through the same services as the API, so the worker and the host workers, still running, do the
work: agents stop their ranks, supervisors their replicas. It waits until nothing is active and
every device they held is given back (which happens once the hosts report their processes gone),
or `--wait` seconds have passed, and names what still runs then.
"""

from __future__ import annotations

import time
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django.db.models import Q

from deployments import services as deployment_services
from deployments.models import Deployment
from hosts.models import DeviceClaim
from runs import services as run_services
from runs.models import Run

POLL_SECONDS = 0.5


class Command(BaseCommand):
    help = "Cancel every active run and stop every active deployment, then wait for them to end."

    def add_arguments(self, parser: ArgumentParser) -> None:
        parser.add_argument("--wait", type=float, default=90.0, help="seconds to wait for everything to end")

    def handle(self, *args: Any, wait: float, **options: Any) -> None:
        runs = list(Run.objects.filter(status__in=Run.ACTIVE))
        deployments = list(Deployment.objects.filter(status__in=Deployment.ACTIVE))
        for run in runs:
            run_services.do_cancel_run(run)
            self.stdout.write(f"run {run.pk} ({run.name}): cancelling")
        for deployment in deployments:
            deployment_services.do_stop_deployment(deployment)
            self.stdout.write(f"deployment {deployment.pk} ({deployment.name}): stopping")
        deadline = time.monotonic() + wait
        while True:
            left = [f"run {r.pk} ({r.name}, {r.status})" for r in Run.objects.filter(status__in=Run.ACTIVE)]
            left += [
                f"deployment {d.pk} ({d.name}, {d.status})"
                for d in Deployment.objects.filter(status__in=[*Deployment.ACTIVE, Deployment.Status.STOPPING])
            ]
            held = DeviceClaim.objects.filter(Q(run__in=runs) | Q(deployment__in=deployments))
            left += [f"device {claim} (its process is exiting)" for claim in held.select_related("host")]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(POLL_SECONDS)
        if left:
            self.stdout.write(f"still running after {wait:.0f} s: {', '.join(left)}")
        elif runs or deployments:
            self.stdout.write("every run and deployment has ended")
