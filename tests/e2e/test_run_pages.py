"""A user launches and follows a training run in the browser, against real processes throughout:
the web process (uvicorn), a Celery worker, node agents and gloo ranks. Nothing is faked."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Locator, Page, expect

from tests.e2e.conftest import ConsoleWatch, log_in, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.slow]

STORY = "\n".join(
    f"{name} walked to the {place} and counted {n} {thing} before the rain."
    for n, (name, place, thing) in enumerate(
        [
            (a, b, c)
            for a in ("Ada", "Bruno", "Chiara", "Dmitri")
            for b in ("harbour", "mill", "library")
            for c in ("pears", "kites", "lanterns")
        ]
    )
)
# A run on two ranks trains in well under a minute here; the limit only stops a hang.
RUN_TIMEOUT_MS = 400_000

# Records every value the loss chart's point count takes, from the moment the page loads,
# so the test can tell points that arrived live from a curve drawn once at the end.
RECORD_LOSS_POINTS = """
window.lossPointCounts = [];
document.addEventListener("DOMContentLoaded", () => {
  const chart = document.getElementById("chart-loss");
  if (!chart) return;
  const note = () => window.lossPointCounts.push(Number(chart.dataset.points || 0));
  note();
  new MutationObserver(note).observe(chart, { attributes: true, attributeFilter: ["data-points"] });
});
"""


def field(page: Page, label: str) -> Locator:
    return page.get_by_label(label, exact=True)


def fill_in(page: Page, label: str, value: str) -> None:
    field(page, label).fill(value)


@pytest.mark.django_db(transaction=True)
def test_a_bad_value_shows_the_apis_message_next_to_its_input_and_keeps_every_other_input(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    console.allow_http_error("/api/runs/", 400)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="New run").first.click()
    fill_in(page, "Name", "three-way split")
    fill_in(page, "Data parallel (dp)", "1")
    fill_in(page, "Tensor parallel (tp)", "3")
    fill_in(page, "Steps", "12")
    fill_in(page, "Learning rate", "0.002")
    field(page, "Activation recompute").select_option("full")
    page.get_by_role("button", name="Launch run").click()

    tp = field(page, "Tensor parallel (tp)")
    error = page.locator('[data-error-for="spec.layout.tp"]')
    expect(error).to_have_text("must divide model.n_heads; got tp=3, n_heads=4")
    expect(tp).to_have_attribute("aria-invalid", "true")
    expect(tp).to_be_focused()
    assert error.get_attribute("id") in (tp.get_attribute("aria-describedby") or "").split()
    # Nothing the user typed is lost, and no other input claims an error.
    assert field(page, "Name").input_value() == "three-way split"
    assert tp.input_value() == "3"
    assert field(page, "Steps").input_value() == "12"
    assert field(page, "Learning rate").input_value() == "0.002"
    assert field(page, "Activation recompute").input_value() == "full"
    assert page.locator(".field-error:not([hidden])").count() == 1
    assert page.url.endswith("/runs/new")

    # Fixing the value clears its error as the user types.
    fill_in(page, "Tensor parallel (tp)", "2")
    expect(error).to_be_hidden()
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_a_run_launched_from_the_form_draws_its_loss_live_and_shows_the_restart_after_a_killed_rank(
    alice, live_web, celery_worker, browser_page: Page, console: ConsoleWatch, tmp_path
):
    page = browser_page
    page.add_init_script(RECORD_LOSS_POINTS)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="New run").first.click()
    # The form's script runs (it fills the placeholders): a file set before it listens is not
    # uploaded (CI saw the status stay empty on a loaded machine).
    expect(page.get_by_label("Steps", exact=True)).to_have_attribute("placeholder", re.compile(r"\d"))

    corpus = tmp_path / "stories.txt"
    corpus.write_text(STORY)
    field(page, "Or upload a .txt or .jsonl file").set_input_files(str(corpus))
    expect(page.locator("#f-file-status")).to_contain_text("Uploaded stories.txt")
    expect(field(page, "Use a dataset")).to_contain_text("stories.txt")

    fill_in(page, "Name", "survives a kill")
    fill_in(page, "Data parallel (dp)", "2")
    fill_in(page, "Steps", "8")
    fill_in(page, "Global batch (sequences)", "4")
    fill_in(page, "Checkpoint every (steps)", "2")
    page.locator("summary", has_text="Inject a fault").click()
    field(page, "Fault").select_option("kill_rank")
    fill_in(page, "On rank", "1")
    fill_in(page, "At step", "6")
    page.get_by_role("button", name="Launch run").click()

    page.wait_for_url(f"{live_web.url}/runs/*")
    expect(page.get_by_role("heading", name="survives a kill")).to_be_visible()
    expect(page.locator("#stat-layout")).to_have_text("2×1×1")
    expect(page.locator("#rank-grid li")).to_have_count(2)

    # rank 1 dies at step 6: the timeline shows the failure and the restart while it happens.
    # Checkpoints are written in the background (the default), so the one of step 4 may still be
    # in flight when the rank dies. The one of step 2 is committed: rank 0 waits for it before it
    # starts step 4's save, so before step 5's collectives, which rank 1 needs to reach step 6.
    # (At step 5, rank 1 could die while rank 0 still commits step 2: seen once under load.)
    restart = page.locator('#timeline li[data-kind="restarting"]')
    expect(restart).to_be_visible(timeout=RUN_TIMEOUT_MS)
    expect(restart).to_contain_text(re.compile(r"from checkpoint step [24] "))
    resumed_from = re.search(r"from checkpoint step (\d+)", restart.inner_text()).group(1)
    expect(page.locator('#timeline li[data-kind="rank_failed"]')).to_contain_text("Rank 1 failed")
    screenshot(page, "run-page-restarting.png")

    expect(page.locator("#run-status")).to_have_attribute("data-status", "succeeded", timeout=RUN_TIMEOUT_MS)
    loss = page.locator("#chart-loss")
    expect(loss).to_have_attribute("data-points", "8")
    counts = page.evaluate("window.lossPointCounts")
    assert counts[0] == 0, counts  # the page opened before the first step...
    assert any(0 < c < 8 for c in counts), counts  # ...and drew a partial curve before the last
    assert counts == sorted(counts), counts  # points were only ever added, never redrawn from scratch
    assert page.evaluate("performance.getEntriesByType('navigation').length") == 1  # no reload

    rank1 = page.locator('#rank-grid li[data-rank="1"]')
    expect(rank1).to_have_attribute("data-failures", "1")
    expect(rank1).to_contain_text("1 failure")
    expect(page.locator("#stat-restarts")).to_have_text("1")
    expect(page.locator("#stat-step")).to_have_text("8")
    # The ranks resume from the newest state every rank holds: that checkpoint, or a newer
    # in-memory snapshot (taken at steps 2, 3 and 4 of the attempt), never past step 5.
    resumed = page.locator('#timeline li[data-kind="resumed"]')
    expect(resumed).to_contain_text(re.compile(r"step [2-5]\b"))
    resumed_step = int(re.search(r"step (\d+)", resumed.inner_text()).group(1))
    assert int(resumed_from) <= resumed_step <= 5, (resumed_from, resumed.inner_text())
    # Steps 2, 6 and 8, and 4 when its background save committed before the kill: a run resumed
    # from a newer in-memory snapshot does not save step 4 again.
    rows = page.locator("#checkpoint-rows tr")
    expect(rows.nth(2)).to_be_visible()
    assert rows.count() in (3, 4), rows.all_inner_texts()
    expect(page.locator("#log-tail")).not_to_have_text("")
    expect(page.get_by_role("button", name="Cancel")).to_be_hidden()
    screenshot(page, "run-page.png")

    page.get_by_role("link", name="Runs").first.click()
    row = page.locator('#runs-body tr[data-status="succeeded"]')
    expect(row).to_contain_text("survives a kill")
    expect(row).to_contain_text("8/8")
    expect(row.locator("svg.spark")).to_be_visible()
    page.get_by_role("checkbox", name="failed").check()
    expect(page.locator("#runs-body tr")).to_have_count(0)
    assert "status=failed" in page.url
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_check_layout_ranks_the_forms_layout_and_fills_in_a_better_one(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/new")
    fill_in(page, "Data parallel (dp)", "2")
    fill_in(page, "Global batch (sequences)", "8")
    field(page, "Check for hardware").select_option("cpu")
    page.get_by_role("button", name="Check layout").click()

    result = page.locator("#plan-result")
    expect(result).to_contain_text("Your layout (dp2 tp1 pp1 zero0 none) ranks #")
    best = result.locator("tbody tr").first
    label = best.locator("code").inner_text()  # e.g. "dp2 tp1 pp1 zero3 selective mb1"
    screenshot(page, "launch-form-layout-check.png")
    best.get_by_role("button", name="Use").click()
    dims = {part[:2]: part[2:] for part in label.split()[:3]}
    assert field(page, "Data parallel (dp)").input_value() == dims["dp"]
    assert field(page, "Tensor parallel (tp)").input_value() == dims["tp"]
    assert field(page, "Pipeline stages (pp)").input_value() == dims["pp"]
    assert field(page, "Global batch (sequences)").input_value() == "8"  # the rest is left alone
    expect(field(page, "Data parallel (dp)")).to_be_focused()
    console.assert_clean()
