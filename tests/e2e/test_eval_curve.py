"""Held-out evaluation in the browser: the run page plots eval loss beside the training loss and
lists it per checkpoint; the launch form offers the evaluation settings and shows the API's error
for them. Events are recorded straight into the database, as a node agent's would be."""

from __future__ import annotations

import pytest
from playwright.sync_api import Page, expect

from runs import services, specs
from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = pytest.mark.browser


def record(run: Run, kind: str, data: dict) -> None:
    off_loop(lambda: services.do_record_event(run, kind, data))


@pytest.mark.django_db(transaction=True)
def test_the_run_page_plots_eval_loss_beside_the_loss_and_lists_it_per_checkpoint(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    spec = specs.resolve_spec({"train": {"eval_interval": 2}, "data": {"validation_fraction": 0.1}}).to_dict()
    run = off_loop(lambda: Run.objects.create(owner=alice, name="evaluated", spec=spec, status="running"))
    for step in range(1, 5):
        record(run, "metrics", {"step": step, "loss": 6.0 - 0.2 * step, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": 0.1})
    record(run, "eval", {"step": 2, "eval_loss": 5.75, "eval_perplexity": 314.2, "eval_tokens": 1024})

    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    loss = page.locator("#chart-loss")
    expect(loss).to_have_attribute("data-points", "4")
    expect(loss).to_have_attribute("data-eval-points", "1")
    expect(loss.locator(".u-legend")).to_contain_text("eval loss")
    expect(page.locator("#stat-eval-loss")).to_have_text("5.75")

    # Live: the next evaluation and the checkpoint that carries it.
    record(run, "eval", {"step": 4, "eval_loss": 5.5, "eval_perplexity": 244.7, "eval_tokens": 1024})
    off_loop(
        lambda: services.do_ingest_events(
            run, "node-0", [{"seq": 1, "kind": "checkpoint", "time": 1.0e9, "data": {"step": 4, "path": "/x", "eval_loss": 5.5}}]
        )
    )
    expect(loss).to_have_attribute("data-eval-points", "2")
    expect(page.locator("#stat-eval-loss")).to_have_text("5.5")
    expect(page.locator('#checkpoint-rows tr[data-step="4"] td[data-label="Eval loss"]')).to_have_text("5.5")
    expect(page.locator('#timeline li[data-kind="eval"]')).to_have_count(0)  # the chart shows them
    screenshot(page, "run-page-eval-loss.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_the_launch_form_offers_evaluation_and_shows_its_error_next_to_the_input(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    console.allow_http_error("/api/runs/", 400)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/new")
    expect(page.get_by_label("Validation split (share of the data)", exact=True)).to_be_visible()
    expect(page.get_by_label("Validation dataset", exact=True)).to_be_visible()
    page.get_by_label("Evaluate every (steps)", exact=True).fill("5")
    page.get_by_role("button", name="Launch run").click()
    error = page.locator('[data-error-for="spec.train.eval_interval"]')
    expect(error).to_contain_text("needs held-out data")
    expect(page.get_by_label("Evaluate every (steps)", exact=True)).to_have_attribute("aria-invalid", "true")
    console.assert_clean()
