"""The hosts page in a real browser: what each host is, what it holds and when it last beat."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from hosts.models import DeviceClaim, Host
from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = pytest.mark.browser


@pytest.mark.django_db(transaction=True)
def test_the_hosts_page_shows_each_hosts_status_devices_runs_and_last_heartbeat(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    def cluster() -> int:
        now = timezone.now()
        run = Run.objects.create(owner=alice, name="big", spec={}, status="running")
        gpus = [{"index": i, "kind": "gpu", "model": "NVIDIA H100 80GB HBM3", "memory_mb": 81559} for i in range(2)]
        running = [{"key": f"run-{run.pk}-node-0", "pid": 4242, "launch": 1}]
        a = Host.objects.create(name="gpu-a", address="10.9.0.11", devices=gpus, running=running, last_seen=now)
        cpus = [{"index": i, "kind": "cpu"} for i in range(2)]
        Host.objects.create(
            name="cpu-b", address="10.9.0.12", devices=cpus, status="lost", last_seen=now - timedelta(minutes=3)
        )
        DeviceClaim.objects.create(host=a, device=1, run=run, node=0)
        return run.pk

    run_id = off_loop(cluster)
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="Hosts").click()
    expect(page.get_by_role("heading", name="Hosts")).to_be_visible()
    gpu_host = page.locator('tr[data-host="gpu-a"]')
    expect(gpu_host).to_contain_text("ready")
    expect(gpu_host).to_contain_text("10.9.0.11")
    expect(gpu_host).to_contain_text("1 of 2 GPUs free (NVIDIA H100 80GB HBM3)")
    expect(gpu_host).to_contain_text(f"run {run_id} node 0: device 1")
    expect(gpu_host).to_contain_text(f"run-{run_id}-node-0")
    expect(gpu_host).to_contain_text("s ago")
    cpu_host = page.locator('tr[data-host="cpu-b"]')
    expect(cpu_host).to_contain_text("lost")
    expect(cpu_host).to_contain_text("2 of 2 CPU slots free")
    expect(cpu_host).to_contain_text("3 min ago")
    screenshot(page, "hosts.png")
    console.assert_clean()
