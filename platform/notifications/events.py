"""The events a webhook can hear, by the status change that causes them.

`runs.services` and `deployments.services` fan out from these (through notifications.services)
in the one place each status change is recorded; a webhook hears the ones it chose (`events`).
"""

from __future__ import annotations

RUN_EVENTS = {
    "succeeded": "run.succeeded",
    "failed": "run.failed",
    "restarting": "run.restarting",
    "cancelled": "run.cancelled",
}
DEPLOYMENT_EVENTS = {"ready": "deployment.ready", "failed": "deployment.failed", "stopped": "deployment.stopped"}
EVENTS = [*RUN_EVENTS.values(), *DEPLOYMENT_EVENTS.values()]


def all_events() -> list[str]:
    """A new webhook's events unless it names some: every one."""
    return list(EVENTS)
