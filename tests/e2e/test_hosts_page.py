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
            name="cpu-b", address="10.9.0.12", devices=cpus, status="lost", last_seen=now - timedelta(minutes=3),
            running=[{"key": "deployment-9", "pid": 77, "launch": 1}],  # its last word before it was lost
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
    expect(cpu_host).not_to_contain_text("deployment-9")  # a lost host runs nothing anyone knows of
    expect(page.get_by_role("button", name="Drain")).to_have_count(0)  # staff only
    screenshot(page, "hosts.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_staff_drain_undrain_and_remove_hosts_from_the_page_and_a_host_holding_work_is_not_removed(
    alice, live_web, browser_page: Page, console: ConsoleWatch, django_user_model
):
    def cluster() -> None:
        django_user_model.objects.create_user("root", password="root-password-1", is_staff=True)
        run = Run.objects.create(owner=alice, name="big", spec={}, status="running")
        cpus = [{"index": i, "kind": "cpu"} for i in range(2)]
        busy = Host.objects.create(name="busy", address="10.9.0.21", devices=cpus, last_seen=timezone.now())
        Host.objects.create(name="idle", address="10.9.0.22", devices=cpus, status="lost", last_seen=timezone.now())
        DeviceClaim.objects.create(host=busy, device=0, run=run, node=0)

    off_loop(cluster)
    page = browser_page
    console.allow_http_error("/api/hosts/", 409)
    log_in(page, live_web.url, "root", "root-password-1")
    page.goto(f"{live_web.url}/hosts")
    busy = page.locator('tr[data-host="busy"]')
    busy.get_by_role("button", name="Drain").click()
    expect(busy).to_contain_text("draining")
    busy.get_by_role("button", name="Undrain").click()
    expect(busy).to_contain_text("ready")
    page.on("dialog", lambda dialog: dialog.accept())
    busy.get_by_role("button", name="Remove").click()
    expect(page.get_by_role("alert")).to_contain_text("Could not remove busy: ")
    expect(page.get_by_role("alert")).to_contain_text("host busy still holds devices for run")
    page.locator('tr[data-host="idle"]').get_by_role("button", name="Remove").click()
    expect(page.locator('tr[data-host="idle"]')).to_have_count(0)
    assert off_loop(lambda: sorted(Host.objects.values_list("name", "status"))) == [("busy", "ready")]
    console.assert_clean()
