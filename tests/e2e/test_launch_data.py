"""The launch form offers only the user's own data, and says on the form what the API refuses."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from runs.models import Dataset, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop

pytestmark = pytest.mark.browser


@pytest.mark.django_db(transaction=True)
def test_bob_sees_only_his_own_datasets_and_runs_and_an_unusable_tokenizer_run_is_named(
    alice, bob, live_web, browser_page: Page, console: ConsoleWatch, tmp_path
):
    def objects() -> int:
        corpus = tmp_path / "alice.txt"
        corpus.write_text("alice's words\n")
        Dataset.objects.create(owner=alice, name="alice-diary", format="text", path=str(corpus), records=1)
        Run.objects.create(owner=alice, name="alice-run", spec={}, status="succeeded")
        # Cancelled before it started: it never prepared data, so it has no tokenizer to give.
        return Run.objects.create(owner=bob, name="bob-never-started", spec={}, status="cancelled").pk

    bobs_run = off_loop(objects)
    page = browser_page
    console.allow_http_error("/api/runs/", 400)
    log_in(page, live_web.url, "bob", "bob-password-1")
    page.get_by_role("link", name="New run").first.click()

    tokenizer = page.get_by_label("Tokenizer", exact=True)
    expect(tokenizer.locator("option")).to_have_text(["Train one on the dataset", f"run {bobs_run} · bob-never-started"])
    expect(page.get_by_label("Use a dataset", exact=True).locator("option")).to_have_text(["Built-in demo corpus"])

    tokenizer.select_option(str(bobs_run))
    page.get_by_role("button", name="Launch run").click()
    error = page.locator('[data-error-for="tokenizer_run"]')
    expect(error).to_have_text(f"run {bobs_run} has no tokenizer yet; choose a run that has started training")
    assert page.url.endswith("/runs/new")
    assert off_loop(lambda: Run.objects.filter(owner=bob).count()) == 1
    console.assert_clean()
