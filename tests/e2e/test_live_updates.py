"""The run page follows a run's events live, and keeps following them across a restart of the
web process: it reconnects and resumes after the last event it holds, missing none and
repeating none. Events are recorded straight into the database, as a node agent's would be,
so the test controls exactly what the page should show."""

from __future__ import annotations

import signal

import pytest
from playwright.sync_api import Page, Route, WebSocket, expect

from runs import services, specs
from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = pytest.mark.browser

# The page retries with backoff capped at 10 s; a web process takes a few seconds to start.
RECONNECT_TIMEOUT_MS = 90_000


def create_run(owner, name: str, spec_changes: dict, **fields) -> Run:
    """A run as the API would store it: its spec checked and filled in from the recipe."""
    spec = specs.resolve_spec(spec_changes).to_dict()
    return off_loop(lambda: Run.objects.create(owner=owner, name=name, spec=spec, **fields))


def record(run: Run, kind: str, data: dict) -> None:
    off_loop(lambda: services.do_record_event(run, kind, data))


def ingest(run: Run, seq: int, kind: str, data: dict) -> None:
    """An event as node 0's agent reports it (the ingest adds what the control plane knows)."""
    off_loop(lambda: services.do_ingest_events(run, "node-0", [{"seq": seq, "kind": kind, "time": None, "data": data}]))


def record_metrics(run: Run, steps: range) -> None:
    for step in steps:
        record(
            run,
            "metrics",
            {"step": step, "loss": 6.0 - 0.1 * step, "lr": 1e-3, "tokens_per_s": 900.0 + step, "mfu": 0.12},
        )


@pytest.mark.django_db(transaction=True)
def test_the_run_page_resumes_after_its_last_event_when_the_web_process_restarts(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    # While the web process is down, the socket's reconnects and the log poll fail by design; a
    # poll in flight when the process is killed is reset rather than refused.
    console.allow(r"WebSocket connection to .* failed")
    console.allow(r"Failed to load resource: net::ERR_CONNECTION_(REFUSED|RESET)")
    run = create_run(alice, "followed", {"layout": {"dp": 2}}, status="running")
    sockets: list[WebSocket] = []
    page.on("websocket", lambda socket: sockets.append(socket))
    record_metrics(run, range(1, 4))
    record(run, "rendezvous", {"attempt": 0, "host": "node-a", "ranks": [0, 1], "world_size": 2})

    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    loss = page.locator("#chart-loss")
    live = page.locator("#live-state")
    expect(loss).to_have_attribute("data-points", "3")
    expect(live).to_have_attribute("data-state", "live")
    held = off_loop(lambda: Run.objects.get(pk=run.pk).last_seq)

    live_web.process.send_signal(signal.SIGKILL)
    live_web.process.wait()
    expect(live).to_have_attribute("data-state", "reconnecting")
    record_metrics(run, range(4, 7))  # while no web process is there to tell the page
    live_web.start()

    expect(live).to_have_attribute("data-state", "live", timeout=RECONNECT_TIMEOUT_MS)
    expect(loss).to_have_attribute("data-points", "6")
    assert sockets[0].url.endswith("?after=0")
    assert sockets[-1].url.endswith(f"?after={held}")  # resumed after what it held, not from the start

    # A rank goes down: its tile turns red at once, and back once the group re-forms.
    record(
        run,
        "rank_failed",
        {"rank": 1, "host": "node-a", "reason": "exited", "exit_code": 1, "signal": None, "last_step": 6},
    )
    rank1 = page.locator('#rank-grid li[data-rank="1"]')
    expect(rank1).to_have_attribute("data-state", "failed")
    expect(rank1).to_contain_text("1 failure: exited (exit 1)")
    record(run, "restarting", {"attempt": 1, "from_step": 4, "reason": "rank failed", "restarts_left": 2})
    record(run, "rendezvous", {"attempt": 1, "host": "node-a", "ranks": [0, 1], "world_size": 2})
    expect(rank1).to_have_attribute("data-state", "running")
    expect(rank1).to_have_attribute("data-failures", "1")
    expect(page.locator('#timeline li[data-kind="restarting"]')).to_contain_text("from checkpoint step 4")
    # The run's guard rolled it back after a loss spike: the timeline says from where to where and why.
    record(run, "rolled_back", {
        "step": 9, "to_step": 6, "source": "memory", "skipped_batches": 3, "rollbacks": 1,
        "reason": "loss spike at step 9: 41.2 is 80.0 standard deviations above the mean of the steps before it",
    })  # fmt: skip
    rolled_back = page.locator('#timeline li[data-kind="rolled_back"]')
    expect(rolled_back).to_contain_text("Rolled back from step 9 to 6")
    expect(rolled_back).to_contain_text("loss spike at step 9: 41.2 is 80.0 standard deviations")
    expect(rolled_back).to_contain_text("resumed from the in-memory snapshot of step 6 and skipped 3 batches (rollback 1)")
    # Rank 0 names rank 1 a straggler; the control plane adds its host, from the rendezvous that placed it.
    ingest(run, 1, "straggler", {"step": 12, "rank": 1, "steps": 20, "own_s": 0.25, "others_s": 0.05, "slower_by": 5.0})
    expect(rank1).to_have_attribute("data-straggling", "true")
    expect(rank1).to_contain_text("straggling: 250 ms of its own a step against its peers' 50 ms, 20 steps in a row")
    straggler = page.locator('#timeline li[data-kind="straggler"]')
    expect(straggler).to_contain_text("Rank 1 straggles")
    expect(straggler).to_contain_text("on node-a: straggling: 250 ms")
    ingest(run, 2, "straggler_cleared", {"step": 40, "rank": 1, "steps": 20, "own_s": 0.05, "others_s": 0.05, "slower_by": 1.0})
    expect(rank1).to_have_attribute("data-straggling", "false")
    expect(page.locator('#timeline li[data-kind="straggler_cleared"]')).to_contain_text("Rank 1 back in line")
    # Where the time went, read again after the events that moved it: steps, then the failure's down time.
    expect(page.locator('#goodput-rows tr[data-bucket="productive"]')).to_contain_text("Productive steps")
    expect(page.locator('#goodput-rows tr[data-bucket="down"]')).to_contain_text("Down after failures")
    expect(page.locator("#goodput-share")).to_contain_text("goodput")

    # Every event once: the timeline holds each non-metrics event's seq exactly once.
    expected = off_loop(lambda: list(run.events.exclude(kind="metrics").order_by("seq").values_list("seq", flat=True)))
    expect(page.locator("#timeline li")).to_have_count(len(expected))
    shown = [int(s) for s in page.locator("#timeline li").evaluate_all("items => items.map(li => li.dataset.seq)")]
    assert sorted(shown) == expected
    screenshot(page, "run-page-after-web-restart.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_cancel_resume_and_clone_act_on_the_run_and_the_buttons_follow_its_status(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    run = create_run(alice, "steered", {"train": {"steps": 20}}, status="running")
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    cancel = page.get_by_role("button", name="Cancel")
    resume = page.get_by_role("button", name="Resume")
    expect(cancel).to_be_visible()
    expect(resume).to_be_hidden()

    page.once("dialog", lambda dialog: dialog.dismiss())  # asked first; "no" leaves the run alone
    cancel.click()
    expect(cancel).to_be_enabled()
    assert off_loop(lambda: Run.objects.get(pk=run.pk).cancel_requested) is False
    page.once("dialog", lambda dialog: dialog.accept())
    cancel.click()
    expect(page.locator('#timeline li[data-kind="cancel_requested"]')).to_be_visible()
    expect(cancel).to_be_hidden()  # asked once; the agent answers with "cancelled"
    # The node agent stops its ranks and reports it, as a real one would.
    off_loop(
        lambda: services.do_ingest_events(
            run, "node-0", [{"seq": 1, "kind": "cancelled", "data": {"step": 0, "reason": "cancelled by the user"}}]
        )
    )
    expect(page.locator("#run-status")).to_have_attribute("data-status", "cancelled")
    expect(resume).to_be_visible()

    resume.click()
    expect(page.locator("#run-status")).to_have_attribute("data-status", "queued")
    expect(resume).to_be_hidden()
    expect(cancel).to_be_visible()

    # The launch form, filled in from the run. Launch waits for the source run's values: clicked
    # before they were in, it launched the recipe's defaults (a run named "run", seen on a loaded
    # CI box). The source run's answer is held back here to look at the form meanwhile.
    held: list[Route] = []
    # Only the form's request, known by the page that sent it: the run page reads the same URL
    # while it is still open, and its request may still be on its way as the frame navigates to
    # the form (the frame's URL is then the form's; held, it left the form's own request waiting
    # behind it on a loaded CI box).
    page.route(
        f"**/api/runs/{run.pk}/",
        lambda route: held.append(route) if "/runs/new" in (route.request.headers.get("referer") or "") else route.continue_(),
    )
    page.get_by_role("link", name="Clone…").click()
    launch = page.get_by_role("button", name="Launch run")
    for _ in range(600):  # up to 30 s for the form page to ask (a loaded CI box is slow)
        if held:
            break
        page.wait_for_timeout(50)
    assert held, "the clone form never asked for its source run"
    expect(launch).to_be_disabled()
    held[0].continue_()
    expect(page.get_by_label("Name", exact=True)).to_have_value("steered (clone)")
    expect(launch).to_be_enabled()
    launch.click()
    expect(page.get_by_role("heading", name="steered (clone)")).to_be_visible()
    clone = off_loop(lambda: Run.objects.get(name="steered (clone)"))
    assert page.url == f"{live_web.url}/runs/{clone.pk}"
    assert clone.spec == off_loop(lambda: Run.objects.get(pk=run.pk).spec)
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_every_page_fits_a_phone_screen_and_its_controls_have_labels(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    run = create_run(alice, "a run with a rather long name", {"layout": {"dp": 2}})
    record_metrics(run, range(1, 6))
    page.set_viewport_size({"width": 390, "height": 844})
    log_in(page, live_web.url, "alice", "alice-password-1")
    for path, ready, name in (
        ("/", '#runs-body tr[data-status="queued"]', "phone-runs.png"),
        ("/runs/new", "#f-dataset option", "phone-launch-form.png"),
        (f"/runs/{run.pk}", '#chart-loss[data-points="5"]', "phone-run-page.png"),
        ("/deployments", "#deployments-empty:not([hidden])", "phone-deployments.png"),
        ("/projects", "#new-project", "phone-projects.png"),
    ):
        page.goto(live_web.url + path)
        expect(page.locator(ready).first).to_be_attached()
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        assert overflow <= 0, f"{path} scrolls sideways by {overflow} px on a phone"
        unlabelled = page.locator("input:not([type=hidden]), select, textarea").evaluate_all(
            "els => els.filter(el => !el.labels.length && !el.getAttribute('aria-label')).map(el => el.outerHTML)"
        )
        assert not unlabelled, f"{path}: controls without a label: {unlabelled}"
        assert page.locator("[onclick]:not(button):not(a)").count() == 0  # actions are buttons, not divs
        screenshot(page, name)
    console.assert_clean()
