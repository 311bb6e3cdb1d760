"""Celery tasks for hosts: watching their heartbeats and placing queued runs on them."""

from __future__ import annotations

from celery import shared_task
from django.conf import settings

from controlplane.queue import enqueue_on_commit
from hosts import recovery, scheduling, services
from launch import run_agents
from runs import placement_moves
from runs import services as run_services
from runs.models import Run


class RunsSide:
    """The runs' side of a placement pass (`scheduling.RunsSide`): runs.services records what
    happens to each run; its earlier agents' locks or hosts' reports say whether they still run."""

    still_stopping = staticmethod(run_agents.agents_alive)
    move_to_starting = staticmethod(placement_moves.do_move_to_starting)
    note_waiting = staticmethod(run_services.do_note_waiting)
    note_waiting_many = staticmethod(placement_moves.do_note_waiting_many)
    preempt = staticmethod(placement_moves.do_preempt)
    request_stop = staticmethod(placement_moves.request_stop)


RUNS_SIDE = RunsSide()


def schedule_and_start() -> list[int]:
    """One placement pass, then the start tasks of each run it placed; returns those runs."""
    placed = scheduling.schedule(RUNS_SIDE)
    for run_id in placed:
        run_agents.start_on_hosts(Run.objects.get(pk=run_id))
    return placed


@shared_task
def schedule_runs() -> list[int]:
    return schedule_and_start()


@shared_task
def watch_hosts() -> list[str]:
    """Marks silent hosts lost, then offers queued runs the free devices. Returns the lost."""
    lost = services.do_mark_lost(settings.HOST_LOST_AFTER_SECONDS)
    for host in lost:
        recovery.do_handle_lost_host(host)
    if lost:
        # The deployments' replicas there go out of their routing now, not at the next reconcile
        # tick (15 s): until then a router still tries them, and an unreachable host costs a
        # request a connect timeout before it fails over.
        enqueue_on_commit("deployments.tasks.reconcile_deployments")
    schedule_and_start()
    return [host.name for host in lost]
