"""The bridge between deployment rows and `serving`'s detached replica supervisors.

The supervisor process owns the replicas; this module has the deployment's executor
(`launch.executors.for_deployment`) start and stop its supervisors, with the options
`deployments.options` resolved, and turns their state and event files and the replicas' /metrics
into the deployment's rows and events.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from deployments import services, shipped
from deployments.models import Deployment, Replica
from deployments.options import device, host_refusal, stored_options
from hosts import replica_placement
from hosts.models import DeviceClaim, Host
from launch import executors, supervisors
from launch.supervisors import SupervisorRequest
from runs import exports
from serving import replica_metrics
from serving.deployment_config import DeploymentConfig
from serving.state import DeploymentDir, DeploymentState, read_events, read_state, supervisor_dirs, write_state
from serving.vllm import replica_dtype

# Replica metrics are scraped with this budget each sync; a replica slower than that is skipped
# this round rather than holding up every other deployment's sync.
SCRAPE_TIMEOUT_SECONDS = 1.5


def config_for(
    deployment: Deployment,
    export_path: str,
    group: replica_placement.ReplicaGroup | None = None,
    adapters: dict[str, str] | None = None,
) -> DeploymentConfig:
    """The supervisor's config: on this machine (all replicas), or for the replicas `group` puts
    on one host (at its address, shipping its folder to ours), with the options the deployment
    stored resolved at create and its `adapters` (name → PEFT folder, `adapter_exports`)."""
    host = group.host if group is not None else None
    stored = stored_options(deployment.options)
    # "auto" becomes the dtype the quantization's kernels take on the replicas' CPU.
    options = dataclasses.replace(
        stored, dtype=replica_dtype(stored, host.serving_device() if host is not None else device())
    )
    folder = DeploymentDir(deployment.folder)
    cores = os.cpu_count() or 1
    config = DeploymentConfig(
        name=deployment.served_model_name,
        export=str(export_path),
        state_dir=str(folder.on_host(host.name).path if host is not None else folder.path),
        python=settings.VLLM_PYTHON,
        replicas=len(group.replicas) if group is not None else deployment.replicas,
        first_replica=group.first_replica if group is not None else 0,
        options=options,
        adapters=adapters or {},
        routing=deployment.routing,
        # Replicas listen on their host's address, where the router reaches them.
        host=host.address if host is not None else "127.0.0.1",
        ports=(settings.REPLICA_PORTS.start, settings.REPLICA_PORTS.stop - 1),
        # On CPU, vLLM's "auto" binding pins every replica to the same first core; spread them
        # (on a host, its worker knows its cores and names each slot's to the supervisor).
        cpu_binds=tuple(str(slot % cores) for slot in range(deployment.replicas))
        if group is None and options.device == "cpu" and options.cpu_threads_bind == "auto"
        else (),
    )
    if host is None:
        return config
    # A host keeps its supervisor's folder to itself (launch.supervisors puts it there); the
    # supervisor ships state, events and logs to our copy, `state_dir` here,
    # DEPLOY_DIR/hosts/<host>/ (deployments.shipped), which every reader reads.
    return dataclasses.replace(
        config, ship_url=f"{settings.PUBLIC_URL}/api/deployments/{deployment.pk}/shipped/",
        ship_token=shipped.supervisor_token(deployment.pk, host.name), ship_host=host.name,
    )  # fmt: skip


def _request(
    deployment: Deployment, export_path: Callable[[], str], replicas: list[int], adapters: dict[str, str] | None = None
) -> SupervisorRequest:
    """`export_path` is asked for as each supervisor's config is built, once its replicas are placed."""
    options = stored_options(deployment.options)
    return SupervisorRequest(
        deployment=deployment, replicas=replicas, kind="gpu" if options.device == "cuda" else "cpu",
        per_replica=options.tensor_parallel_size, refusal=lambda host: host_refusal(options, host),
        configure=lambda group: config_for(deployment, export_path(), group, adapters),
    )  # fmt: skip


def _export_path(deployment: Deployment) -> str:
    """The folder (or object-storage URL) its replicas serve: a pretrained model's own folder, a
    quantized export, or the checkpoint's export, merged for a LoRA run's (made now if there is
    none yet)."""
    if deployment.pretrained is not None:
        return deployment.pretrained.path
    if deployment.quantized_export is not None:
        return deployment.quantized_export.path
    assert deployment.checkpoint is not None
    if deployment.merged:
        return exports.export_merged(deployment.checkpoint)
    return exports.export(deployment.checkpoint)


def adapter_exports(deployment: Deployment) -> dict[str, str]:
    """Each attached adapter's PEFT folder by its name, exported first where it is not yet (a LoRA
    checkpoint's export is its adapter folder, `training.export`)."""
    return {a.name: exports.export(a.checkpoint) for a in deployment.adapters.select_related("checkpoint__run")}


def start(deployment: Deployment) -> int | None:
    """Exports the checkpoint if needed and has the deployment's executor start its supervisors:
    one here (returns its pid), or one on each host placement gave some of its replicas (returns
    None). Raises supervisors.NotPlaced when no host has room for them now."""
    export_path = _export_path(deployment)  # an export that fails fails the deployment before anything is placed
    adapters = adapter_exports(deployment)
    started = executors.for_deployment(deployment).start_supervisors(
        _request(deployment, lambda: export_path, list(range(deployment.replicas)), adapters)
    )
    with transaction.atomic():
        for index in range(deployment.replicas):
            Replica.objects.get_or_create(deployment=deployment, index=index)
        if started.placed:
            services.do_record(deployment, "placed", {"hosts": started.placed})
    return started.pid


def resize(deployment: Deployment) -> bool:
    """Has the executor bring the running deployment's supervisors to `deployment.replicas`
    (its autoscaler moved it): see `Executor.change_replicas`."""
    export_path = functools.cache(functools.partial(_export_path, deployment))
    request = _request(deployment, export_path, list(range(deployment.replicas)), adapter_exports(deployment))
    return executors.for_deployment(deployment).change_replicas(deployment, request)


def lose_hosts(deployment: Deployment) -> bool:
    """The deployment's replicas on lost hosts went with them: their devices go back (a lost host
    that returns gets nothing new while what still runs there of them is stopped,
    `hosts.scheduling.orphans_on`), their rows are dead, and the control plane's copy of those hosts'
    state no longer routes to them. The deployment serves on with the replicas left, degraded,
    until `place_missing` has placed the lost ones again; with none left, it fails. Either way its
    reason names the hosts. True when it failed."""
    serving = [Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED]
    with transaction.atomic():
        lost = list(
            DeviceClaim.objects.select_for_update(of=("self",)).filter(deployment=deployment, host__status=Host.Status.LOST)
        )
        if not lost:
            return False
        hosts = sorted(set(Host.objects.filter(pk__in={c.host_id for c in lost}).values_list("name", flat=True)))
        replicas = sorted({c.node for c in lost})
        DeviceClaim.objects.filter(pk__in=[c.pk for c in lost]).delete()
        Replica.objects.filter(deployment=deployment, index__in=replicas).update(
            status=Replica.Status.DEAD, url="", updated_at=timezone.now()
        )
        for name in hosts:
            _forget_replicas(DeploymentDir(deployment.folder).on_host(name))
        word = "replica" if len(replicas) == 1 else "replicas"
        reason = f"host {', '.join(hosts)} was lost with {word} {', '.join(map(str, replicas))}"
        data = {"hosts": hosts, "replicas": replicas, "reason": reason}
        if DeviceClaim.objects.filter(deployment=deployment).exists():
            services.do_set_status(
                deployment, Deployment.Status.DEGRADED, only_from=serving, reason=reason, event="host_lost", data=data
            )
            return False
        return services.do_set_status(
            deployment, Deployment.Status.FAILED, only_from=serving, reason=reason, event="failed", data=data
        )


def _forget_replicas(folder: DeploymentDir) -> None:
    """Marks every replica of a lost host's supervisor failed, without an address, in our copy of
    its state: routers and `sync` read that copy, and the host answers no more."""
    try:
        state = DeploymentState.from_dict(json.loads(folder.state_file.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return
    for replica in state.replicas:
        replica.phase, replica.url = "failed", None
    write_state(folder, state)


def place_missing(deployment: Deployment) -> list[int]:
    """Places again the replicas of a degraded deployment that hold no device (their host was
    lost), on ready hosts that have room and run none of its replicas, and starts their
    supervisors; returns the replicas placed. Those that do not fit wait for the next call."""
    executor = executors.for_deployment(deployment)
    held = executor.replicas_placed(deployment)
    if held is None:
        return []  # nothing placed: its one supervisor restarts its replicas itself
    missing = [i for i in range(deployment.replicas) if i not in held]
    # Looked up once a block is placed, and once a call: on object storage it reads the export's
    # manifest, which a block that does not fit (every reconcile tick, while none has room) needs not.
    export_path = functools.cache(functools.partial(_export_path, deployment))
    placed: list[int] = []
    # A host's replicas are numbered consecutively: each run of missing indexes is placed as one.
    for block in _runs_of(missing):
        try:
            started = executor.start_supervisors(_request(deployment, export_path, block))
        except supervisors.NotPlaced:
            continue
        services.do_record(deployment, "placed", {"hosts": started.placed, "again": block})
        placed += block
    return placed


def _runs_of(indexes: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in indexes:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs


def stop(deployment: Deployment, timeout: float = 120.0) -> None:
    """Asks the supervisors to drain and stop their replicas, and waits up to `timeout` for
    them to exit (0: asks and returns)."""
    if not executors.for_deployment(deployment).stop_supervisors(deployment):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = read_state(deployment.folder)
        if state is None or all(r.phase == "stopped" for r in state.replicas):
            return
        time.sleep(0.5)


def sync(deployment: Deployment) -> dict[str, Any] | None:
    """Mirrors replica state, moves the status, stores new replica events, scrapes metrics;
    returns the metrics scraped (None when no replica was ready to scrape).

    Rows change before the events that announce them are stored, in one transaction: events are
    published after it commits, so a page that reads the deployment on an event sees the state
    the event describes. The transaction holds the deployment's row, where the events offsets
    are kept: syncs that overlap (the periodic one and a stop's) store each event once."""
    ready: list[Any] = []
    with transaction.atomic():
        offsets = Deployment.objects.select_for_update().values_list("event_offsets", flat=True).get(pk=deployment.pk)
        events: list[Any] = []
        for folder in supervisor_dirs(deployment.folder):
            name = str(folder.path.relative_to(deployment.folder))
            new_events, offsets[name] = read_events(folder.path, offsets.get(name, 0))
            events += new_events
        state = read_state(deployment.folder)
        if state is not None:
            # On hosts, a replica counts only while it holds its devices: one of a host lost and
            # back may report itself ready until its orphaned supervisor is stopped.
            replicas = _current(deployment, state.replicas)
            mirror_replicas(deployment, replicas)
            ready = [r for r in state.routable() if any(r is current for current in replicas)]
        for event in events:
            services.do_record(deployment, event.kind, {k: v for k, v in event.to_dict().items() if k not in ("kind", "at")})
        if events:
            Deployment.objects.filter(pk=deployment.pk).update(event_offsets=offsets)
        if state is not None and not state.stopping:
            # A replica its autoscaler added and that is still on its first start, or one it
            # removed that is draining, degrades nothing: the others serve as they did.
            changing = all(
                r.phase in ("ready", "draining", "stopped") or (r.phase == "starting" and r.restarts == 0)
                for r in replicas
            )
            new_status = (
                Deployment.Status.READY if len(ready) == deployment.replicas
                else Deployment.Status.DEGRADED
                if ready and deployment.status != Deployment.Status.STARTING and not changing
                else None
            )
            serving = [Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED]
            if new_status:
                services.do_set_status(
                    deployment, new_status, only_from=[s for s in serving if s != new_status],
                    data={"status": new_status, "ready": len(ready), "replicas": len(state.replicas)},
                )  # fmt: skip
    for event in events:
        if event.kind == "replica_failed":
            fail_on_replica(deployment, event.replica, event.message)
            return None
    if not ready:
        return None
    metrics = scrape(deployment.folder, [r.url for r in ready if r.url])
    services.do_record(deployment, "metrics", metrics)
    return metrics


def _current(deployment: Deployment, replicas: list[Any]) -> list[Any]:
    """Each replica's state as its current supervisor reports it: on hosts, only replicas that hold
    their devices (one of a host lost and back reports itself until its supervisor is stopped),
    and of a replica placed again after its host was lost, the new one, not the forgotten one."""
    held = executors.for_deployment(deployment).replicas_placed(deployment)
    if held is not None:
        replicas = [r for r in replicas if r.index in held]
    chosen: dict[int, Any] = {}
    for replica in replicas:
        if replica.index not in chosen or chosen[replica.index].phase == "failed":
            chosen[replica.index] = replica
    return [chosen[index] for index in sorted(chosen)]


def fail_on_replica(deployment: Deployment, index: int, why: str) -> None:
    """A replica gave up starting (it died the same way at every start): its deployment fails
    with the replica's error line, and what still runs of it is stopped, for its devices go back
    to the cluster with the failure."""
    reason = f"replica {index} could not start: {why}"
    serving = [Deployment.Status.STARTING, Deployment.Status.READY, Deployment.Status.DEGRADED]
    hosts = supervisors.placed_hosts(deployment)  # read before the failure gives their devices back
    if services.do_set_status(
        deployment, Deployment.Status.FAILED, only_from=serving, reason=reason, event="failed", data={"reason": reason}
    ):
        executors.for_deployment(deployment).stop_supervisors(deployment, hosts)


def replica_status(phase: str, last_exit_code: int | None) -> str:
    if phase == "ready":
        return Replica.Status.READY
    if phase == "stopped":
        return Replica.Status.STOPPED
    if phase == "failed" or (phase == "restarting" and last_exit_code is not None):
        return Replica.Status.DEAD
    return Replica.Status.STARTING


def mirror_replicas(deployment: Deployment, replicas: Any) -> None:
    """Copies the supervisor's view of each replica into its row; `updated_at` moves only when
    something changed, so the page's "since" is when the replica reached its state."""
    rows = {r.index: r for r in Replica.objects.filter(deployment=deployment)}
    now = timezone.now()
    for replica in replicas:
        row = rows.get(replica.index)
        if row is None:
            continue
        fields = {
            "url": replica.url or "",
            "pid": replica.pid,
            "status": replica_status(replica.phase, replica.last_exit_code),
            "restarts": replica.restarts,
        }
        if any(getattr(row, name) != value for name, value in fields.items()):
            Replica.objects.filter(pk=row.pk).update(**fields, updated_at=now)


def mark_stopped(deployment: Deployment) -> None:
    """After the supervisor exited nothing of the deployment runs: every replica is stopped."""
    Replica.objects.filter(deployment=deployment).exclude(status=Replica.Status.STOPPED).update(
        status=Replica.Status.STOPPED, updated_at=timezone.now()
    )


def scrape(folder: Path, urls: list[str]) -> dict[str, Any]:
    """The deployment's serving metrics now: summed over the ready replicas (KV-cache use and
    time to first token averaged), tokens/s from the counters' change since the last scrape, and
    each replica's prefix-cache hit rate since it started, by its url (the page's replica cards)."""
    import asyncio

    async def collect() -> list[Any]:
        async with httpx.AsyncClient(trust_env=False) as client:
            return await asyncio.gather(
                *(replica_metrics.scrape(client, url, SCRAPE_TIMEOUT_SECONDS) for url in urls), return_exceptions=True
            )

    now = time.time()
    previous_file = DeploymentDir(folder).metrics_previous_file
    previous: dict[str, list[float]] = json.loads(previous_file.read_text()) if previous_file.exists() else {}
    current: dict[str, list[float]] = {}
    totals: dict[str, float] = {"running": 0.0, "waiting": 0.0, "kv_cache_usage": 0.0, "tokens_per_s": 0.0}
    ttfts: list[float] = []
    hit_rates: dict[str, float | None] = {}
    samples = [(url, r) for url, r in zip(urls, asyncio.run(collect()), strict=True) if isinstance(r, replica_metrics.ReplicaMetrics)]
    for url, sample in samples:
        totals["running"] += sample.requests_running
        totals["waiting"] += sample.requests_waiting
        totals["kv_cache_usage"] += sample.kv_cache_usage / len(samples)
        current[url] = [now, sample.generation_tokens_total]
        if url in previous and now > previous[url][0]:
            before_time, before_total = previous[url]
            # A counter that went down means the replica restarted: count from zero.
            made = sample.generation_tokens_total - before_total if sample.generation_tokens_total >= before_total else sample.generation_tokens_total
            totals["tokens_per_s"] += made / (now - before_time)
        if sample.ttft_p50_s is not None:
            ttfts.append(sample.ttft_p50_s)
        hit_rates[url] = sample.prefix_cache_hit_rate
    previous_file.write_text(json.dumps(current))
    return {
        **totals, "ttft_p50": sum(ttfts) / len(ttfts) if ttfts else None, "replicas_scraped": len(samples),
        "prefix_cache_hit_rate": hit_rates,
    }  # fmt: skip
