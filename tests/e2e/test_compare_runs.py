"""Comparing runs in the browser: three runs chosen in the runs list open the compare page, which
draws a curve per run, lists exactly the spec fields that differ (all of them on demand), keeps a
running run's curve growing, and fits a phone. Runs are database rows with events recorded as the
control plane records them; nothing trains."""

from __future__ import annotations

from typing import Any

import pytest
from playwright.sync_api import Page, expect

from runs import services, specs
from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = pytest.mark.browser


def make_run(owner, name: str, spec: dict[str, Any], status: str, losses: list[float]) -> Run:
    def create() -> Run:
        run = Run.objects.create(owner=owner, name=name, spec=specs.resolve_spec(spec).to_dict(), recipe="tiny", status=status)
        for step, loss in enumerate(losses, start=1):
            metrics = {"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": 800.0 + 10 * step, "mfu": 0.02 * step}
            services.do_record_event(run, "metrics", metrics)
        services.do_record_event(run, "eval", {"step": len(losses), "eval_loss": losses[-1] + 0.1})
        return run

    return off_loop(create)


@pytest.mark.django_db(transaction=True)
def test_three_runs_chosen_in_the_list_compare_curve_by_curve_with_their_spec_differences(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    base = make_run(alice, "baseline", {}, "succeeded", [6.0, 5.2, 4.8, 4.5])
    slower = make_run(alice, "lower lr", {"train": {"lr": 1e-3}}, "succeeded", [6.0, 5.6, 5.3, 5.1])
    wider = make_run(alice, "wider", {"model": {"dim": 256}, "train": {"lr": 1e-3}}, "running", [5.9, 5.0, 4.4])
    make_run(alice, "not chosen", {"train": {"steps": 50}}, "failed", [6.0])

    log_in(page, live_web.url, "alice", "alice-password-1")
    compare = page.get_by_role("button", name="Compare")
    expect(compare).to_be_disabled()
    for run in (base, slower, wider):
        page.get_by_label(f"Select run #{run.pk} to compare").check()
    expect(compare).to_have_text("Compare 3")
    compare.click()
    page.wait_for_url(f"**/runs/compare/?ids={base.pk},{slower.pk},{wider.pk}")

    loss = page.locator("#chart-loss")
    expect(loss).to_have_attribute("data-curves", "3")
    expect(loss).to_have_attribute("data-points", "4")
    for metric in ("eval_loss", "tokens_per_s", "mfu"):
        expect(page.locator(f"#chart-{metric}")).to_have_attribute("data-curves", "3")
    for run in (base, slower, wider):
        expect(loss.locator(".u-legend")).to_contain_text(f"{run.name} #{run.pk}")
    expect(page.locator("#compare-legend li")).to_have_count(3)

    # Exactly the fields that differ, one column per run in the order chosen.
    rows = page.locator("#spec-diff tbody tr")
    expect(rows).to_have_count(4)  # the wider model's head size and MLP width follow its dim
    fields = sorted(rows.evaluate_all("rs => rs.map(r => r.dataset.field)"))
    assert fields == ["model.dim", "model.ffn_dim", "model.head_dim", "train.lr"]
    expect(page.locator('#spec-diff tr[data-field="model.dim"] td')).to_have_text(["128", "128", "256"])
    expect(page.locator('#spec-diff tr[data-field="model.head_dim"] td')).to_have_text(["32", "32", "64"])
    expect(page.locator('#spec-diff tr[data-field="train.lr"] td')).to_have_text(["0.003", "0.001", "0.001"])
    expect(page.locator('#figures tr[data-figure="best.loss"] td')).to_have_text(["4.5 @ 4", "5.1 @ 4", "4.4 @ 3"])
    screenshot(page, "compare-desktop.png")

    page.get_by_label("show all fields").check()
    expect(page.locator('#spec-diff tr[data-field="layout.dp"]')).to_have_attribute("data-differs", "false")
    assert rows.count() > 20
    expect(page.locator('#spec-diff tr[data-differs="true"]')).to_have_count(4)
    assert "all=1" in page.url

    page.get_by_label("log scale").check()
    expect(loss).to_have_attribute("data-scale", "log")
    page.get_by_label("Smoothing").fill("0.6")
    expect(loss).to_have_attribute("data-smoothing", "0.6")

    # The running run's curve keeps growing over its websocket.
    off_loop(lambda: services.do_record_event(wider, "metrics", {"step": 4, "loss": 4.1, "tokens_per_s": 850.0, "mfu": 0.08}))
    expect(page.locator('#figures tr[data-figure="best.loss"] td').nth(2)).to_have_text("4.1 @ 4")
    expect(page.locator("#live-state")).to_have_attribute("data-state", "live")

    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    expect(loss).to_have_attribute("data-curves", "3")
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"the compare page scrolls sideways by {overflow} px on a phone"
    screenshot(page, "compare-phone.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_tags_a_project_and_the_runs_lists_filters_in_its_url_and_a_members_read_only_view(
    alice, bob, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    tagged = make_run(alice, "sweep a", {"layout": {"dp": 2}, "nodes": {"nproc_per_node": 2}}, "succeeded", [6.0, 5.0])
    make_run(alice, "sweep b", {}, "succeeded", [6.0, 5.5])

    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/projects")
    page.get_by_label("Name", exact=True).fill("scaling")
    page.get_by_role("button", name="Create project").click()
    expect(page.get_by_role("heading", name="scaling")).to_be_visible()
    page.get_by_label("Add or change a member (username)").fill("bob")
    page.get_by_role("button", name="Save member").click()
    expect(page.locator('tr[data-username="bob"]')).to_contain_text("read")
    screenshot(page, "projects-page.png")

    page.goto(f"{live_web.url}/runs/{tagged.pk}")
    page.get_by_label("Project", exact=True).select_option(label="scaling")
    page.get_by_label("Tags", exact=True).fill("Bad Tag")
    console.allow_http_error(f"/api/runs/{tagged.pk}/", 400)
    page.get_by_role("button", name="Save tags and note").click()
    expect(page.locator('[data-error-for="tags"]')).to_contain_text("lower-case letters")
    page.get_by_label("Tags", exact=True).fill("sweep, best")
    page.get_by_label("Note", exact=True).fill("Two data-parallel ranks.")
    page.get_by_role("button", name="Save tags and note").click()
    expect(page.locator("#organise-saved")).to_have_text("Saved.")
    expect(page.locator("#run-tag-list .tag")).to_have_text(["sweep", "best"])
    expect(page.locator("#run-project-label")).to_have_text("project scaling")
    screenshot(page, "run-page-tags-and-note.png")

    page.goto(f"{live_web.url}/?search=sweep&tag=best&layout=dp2")
    expect(page.locator("#runs-body tr")).to_have_count(1)
    expect(page.locator("#runs-body tr")).to_contain_text("sweep a")
    expect(page.get_by_label("Layout")).to_have_value("dp2")
    page.get_by_label("Tag", exact=True).fill("")
    page.get_by_label("Layout").fill("")
    expect(page.locator("#runs-body tr")).to_have_count(2)
    assert page.url.endswith("/?search=sweep")
    page.get_by_role("button", name="best").click()  # a row's tag filters by it
    expect(page.locator("#runs-body tr")).to_have_count(1)
    assert "tag=best" in page.url
    page.get_by_label(f"Select run #{tagged.pk} to compare").check()
    screenshot(page, "runs-list-filtered.png")
    page.set_viewport_size({"width": 390, "height": 844})
    expect(page.locator("#runs-body tr")).to_have_count(1)
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 0, f"the runs list scrolls sideways by {overflow} px on a phone"
    screenshot(page, "runs-list-filtered-phone.png")

    # Bob, a read-only member, sees the project's run but nothing that would change it.
    page.set_viewport_size({"width": 1280, "height": 900})
    log_in(page, live_web.url, "bob", "bob-password-1")
    expect(page.locator("#runs-body tr")).to_have_count(1)
    expect(page.locator("#runs-body tr")).to_contain_text("sweep a #1 · alice".replace("#1", f"#{tagged.pk}"))
    page.get_by_role("link", name="sweep a").click()
    expect(page.locator("#run-project-label")).to_have_text("project scaling · launched by alice")
    expect(page.locator("#run-note-text")).to_have_text("Two data-parallel ranks.")
    expect(page.locator("#organise-form")).to_have_count(0)
    expect(page.locator("#chart-loss")).to_have_attribute("data-points", "2")
    console.assert_clean()
