"""Metrics read from the database when `/metrics` is scraped.

These values live in the database already, written by whichever process moved them (the web
process ingesting an agent's events, the worker claiming a launch or syncing a deployment). Read
at scrape, every web process answers the same and a restarted process loses nothing, which
counting in-process could not promise. Each scrape costs a few indexed queries; the queue-wait
histogram reads one row per launch ever made (its time and its queued time, paired in SQL).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Iterator
from datetime import timedelta

from django.conf import settings
from django.db.models import Count, OuterRef, Subquery
from django.utils import timezone
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from deployments.models import Deployment, DeploymentEvent, Replica
from runs.models import Run, RunEvent

# Queue wait runs from seconds (an idle worker) to hours (a busy cluster).
QUEUE_WAIT_BUCKETS = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0, 86400.0)
# Deployments whose replicas run (or are being stopped): their replica states and serving figures.
_SERVING = (*Deployment.ACTIVE, Deployment.Status.STOPPING)


def _serving_figures_fresh_after() -> timedelta:
    """A deployment's last serving figures are shown while the sync task would have replaced
    them: it records them every DEPLOYMENT_SYNC_SECONDS while a replica is ready. Older ones
    describe replicas that are gone, so they are left out rather than shown as current."""
    return timedelta(seconds=max(10.0, 5 * settings.DEPLOYMENT_SYNC_SECONDS))


class DatabaseCollector:
    """A prometheus_client collector for the scrape's own registry (never the default one)."""

    def collect(self) -> Iterator[Metric]:
        yield self._runs()
        yield self._queue_wait()
        yield self._deployments()
        yield from self._serving()

    def _runs(self) -> Metric:
        counts = dict(Run.objects.order_by().values("status").annotate(n=Count("id")).values_list("status", "n"))
        family = GaugeMetricFamily("fathom_runs", "Training runs, by status.", labels=["status"])
        for status in Run.Status.values:
            family.add_metric([status], counts.get(status, 0))
        return family

    def _queue_wait(self) -> Metric:
        """Each launch's wait: from the run's submit (or resume), its `queued` event, to a
        worker's claim, the `status: starting` event that follows it."""
        queued_at = (
            RunEvent.objects.filter(run=OuterRef("run"), kind="queued", seq__lt=OuterRef("seq"))
            .order_by("-seq")
            .values("time")[:1]
        )
        claims = (
            RunEvent.objects.filter(kind="status", data__status=Run.Status.STARTING)
            .annotate(queued_at=Subquery(queued_at))
            .values_list("time", "queued_at")
        )
        counts = [0] * (len(QUEUE_WAIT_BUCKETS) + 1)
        total = 0.0
        for claimed, queued in claims:
            if queued is None:
                continue
            wait = max(0.0, (claimed - queued).total_seconds())
            total += wait
            counts[bisect_left(QUEUE_WAIT_BUCKETS, wait)] += 1  # the first bucket whose bound is >= wait
        cumulative, buckets = 0, []
        for bound, count in zip([*QUEUE_WAIT_BUCKETS, math.inf], counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
        return HistogramMetricFamily(
            "fathom_run_queue_wait_seconds",
            "Time runs waited in the queue: from submit (or resume) to a worker's claim of the launch.",
            buckets=buckets,
            sum_value=total,
        )

    def _deployments(self) -> Metric:
        counts = dict(Deployment.objects.order_by().values("status").annotate(n=Count("id")).values_list("status", "n"))
        family = GaugeMetricFamily("fathom_deployments", "Deployments, by status.", labels=["status"])
        for status in Deployment.Status.values:
            family.add_metric([status], counts.get(status, 0))
        return family

    def _serving(self) -> Iterator[Metric]:
        replicas = GaugeMetricFamily(
            "fathom_replicas", "vLLM replicas of running deployments, by state.", labels=["deployment", "state"]
        )
        kv_cache = GaugeMetricFamily(
            "fathom_deployment_kv_cache_usage_ratio",
            "Fraction of KV-cache blocks in use, averaged over a deployment's ready replicas (last sync).",
            labels=["deployment"],
        )
        requests = GaugeMetricFamily(
            "fathom_deployment_requests",
            "Requests a deployment's ready replicas hold, by state: running or waiting (last sync).",
            labels=["deployment", "state"],
        )
        serving = dict(Deployment.objects.filter(status__in=_SERVING).values_list("pk", "served_model_name"))
        states = (
            Replica.objects.filter(deployment__in=serving).order_by().values("deployment", "status")
            .annotate(n=Count("id")).values_list("deployment", "status", "n")
        )  # fmt: skip
        held = {(deployment, state): n for deployment, state, n in states}
        fresh_after = timezone.now() - _serving_figures_fresh_after()
        for pk, name in serving.items():
            for state in Replica.Status.values:
                replicas.add_metric([name, state], held.get((pk, state), 0))
            last = (
                DeploymentEvent.objects.filter(deployment=pk, kind="metrics", time__gte=fresh_after)
                .order_by("-seq")
                .values_list("data", flat=True)
                .first()
            )
            if last:
                kv_cache.add_metric([name], float(last.get("kv_cache_usage") or 0.0))
                requests.add_metric([name, "running"], float(last.get("running") or 0.0))
                requests.add_metric([name, "waiting"], float(last.get("waiting") or 0.0))
        yield replicas
        yield kv_cache
        yield requests
