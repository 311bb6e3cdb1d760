"""The web process as `controlplane.web` starts it."""

from __future__ import annotations

import os

import httpx


def test_the_web_process_and_its_threads_run_as_batch_tasks(live_web) -> None:
    """It relays every token of /v1 streams; as a batch task it does not preempt the task running
    on its core at each wakeup (serving.app.relay_scheduling). Its threads, Django's database
    thread among them, inherit the policy."""
    assert live_web.process is not None
    assert httpx.get(f"{live_web.url}/login/", timeout=10).status_code == 200  # a sync view: a thread
    threads = os.listdir(f"/proc/{live_web.process.pid}/task")
    assert len(threads) > 1
    assert {os.sched_getscheduler(int(thread)) for thread in threads} == {os.SCHED_BATCH}
