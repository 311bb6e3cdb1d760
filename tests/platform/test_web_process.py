"""The web process as `controlplane.web` starts it."""

from __future__ import annotations

import os

import httpx


def scheduling_policies_of_threads(pid: int) -> set[int]:
    """The policy of each thread of `pid` that is still alive when asked: a worker thread may exit
    between listing /proc/PID/task and reading its policy."""
    policies = set()
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            policies.add(os.sched_getscheduler(int(thread)))
        except ProcessLookupError:
            continue
    return policies


def test_the_web_process_and_its_threads_run_as_batch_tasks(live_web) -> None:
    """It relays every token of /v1 streams; as a batch task it does not preempt the task running
    on its core at each wakeup (serving.app.relay_scheduling). Its threads, Django's database
    thread among them, inherit the policy."""
    assert live_web.process is not None
    assert httpx.get(f"{live_web.url}/login/", timeout=10).status_code == 200  # a sync view: a thread
    assert len(os.listdir(f"/proc/{live_web.process.pid}/task")) > 1
    assert scheduling_policies_of_threads(live_web.process.pid) == {os.SCHED_BATCH}
