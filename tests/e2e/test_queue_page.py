"""The queue page in a real browser: each waiting run's place and why it waits, the head's
reservation, the viewer's quota, and the page following the queue as it moves."""

from __future__ import annotations

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from hosts.models import Host, Quota
from hosts.scheduling import schedule
from hosts.tasks import RUNS_SIDE
from runs import services
from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = pytest.mark.browser

ONE = {"layout": {"dp": 1}, "nodes": {"min": 1, "max": 1, "nproc_per_node": 1}}


@pytest.mark.django_db(transaction=True)
def test_the_queue_page_shows_each_runs_place_why_it_waits_the_reservation_and_the_quota(
    alice, bob, live_web, browser_page: Page, console: ConsoleWatch
):
    def cluster() -> dict[str, int]:
        Host.objects.create(name="c", address="10.9.2.1", devices=[{"index": 0, "kind": "cpu"}], last_seen=timezone.now())
        Quota.objects.create(user=alice, priority_ceiling=3, cpu_slots=4, queued_runs=10)
        runs = {}
        for owner, name, priority in ((alice, "running", 0), (bob, "bobs secret", 1), (alice, "mine", 0)):
            runs[name] = Run.objects.create(owner=owner, name=name, spec=ONE, priority=priority).pk
            if name == "running":
                schedule(RUNS_SIDE)
        schedule(RUNS_SIDE)
        return runs

    runs = off_loop(cluster)
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="Queue").click()
    expect(page.get_by_role("heading", name="Queue")).to_be_visible()
    head = page.locator(f'tr[data-run="{runs["bobs secret"]}"]')
    # Bob's run comes first (priority 1); alice may not see its name.
    expect(head.locator("td").first).to_have_text("1")
    expect(head).to_contain_text(f"run {runs['bobs secret']}")
    expect(head).not_to_contain_text("bobs secret")
    expect(head).to_contain_text(f"holds c:0 in reserve until run {runs['running']} ends")
    expect(head).to_contain_text("Holds in reserve: c:0")
    mine = page.locator(f'tr[data-run="{runs["mine"]}"]')
    expect(mine.locator("td").first).to_have_text("2")
    expect(mine.get_by_role("link", name="mine")).to_have_attribute("href", f"/runs/{runs['mine']}")
    expect(mine).to_contain_text(f"waiting: behind run {runs['bobs secret']} at the head of the queue")
    quota = page.locator("#quota")
    expect(quota).to_contain_text("Highest priority you may submit3")
    expect(quota).to_contain_text("CPU slots your runs hold1 of 4")
    expect(quota).to_contain_text("Your queued runs1 of 10")
    screenshot(page, "queue.png")

    # The running run ends: the head starts on what it held, and the page follows.
    def the_running_run_ends() -> None:
        services.do_set_status(Run.objects.get(pk=runs["running"]), Run.Status.SUCCEEDED)
        schedule(RUNS_SIDE)

    off_loop(the_running_run_ends)
    expect(head).to_have_count(0)
    expect(mine.locator("td").first).to_have_text("1")
    expect(mine).to_contain_text("Holds in reserve: c:0")
    console.assert_clean()
