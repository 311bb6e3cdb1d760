"""The events a webhook can hear, by the status change that causes them.

`runs.services` and `deployments.services` fan out from these (through notifications.services)
in the one place each status change is recorded, and from a run's guard events as they are
stored; a webhook hears the ones it chose (`events`).
"""

from __future__ import annotations

RUN_EVENTS = {
    "succeeded": "run.succeeded",
    "failed": "run.failed",
    "restarting": "run.restarting",
    "cancelled": "run.cancelled",
}
# What a run's own guard did (training/trainer.py), by the event its rank 0 reports: not a status
# change, but what its owner would want to hear of before the run diverges.
GUARD_EVENTS = {"step_skipped": "run.step_skipped", "rolled_back": "run.rolled_back"}
DEPLOYMENT_EVENTS = {"ready": "deployment.ready", "failed": "deployment.failed", "stopped": "deployment.stopped"}
EVENTS = [*RUN_EVENTS.values(), *GUARD_EVENTS.values(), *DEPLOYMENT_EVENTS.values()]


def all_events() -> list[str]:
    """A new webhook's events unless it names some: every one."""
    return list(EVENTS)
