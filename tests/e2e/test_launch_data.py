"""The launch form offers only the user's own data, and says on the form what the API refuses."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from runs.models import Dataset, PretrainedModel, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop
from tests.platform.test_pretrained_api import write_llama_folder

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


@pytest.mark.django_db(transaction=True)
def test_a_llama_folder_uploaded_on_the_form_is_what_the_run_starts_from(
    alice, live_web, browser_page: Page, console: ConsoleWatch, tmp_path
):
    folder = write_llama_folder(tmp_path / "llama")
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="New run").first.click()
    start_from = page.get_by_label("Start from", exact=True)
    expect(start_from.locator("option")).to_have_text(["A new model (the recipe's sizes)"])
    expect(page.get_by_label("Steps", exact=True)).to_have_attribute("placeholder", re.compile(r"\d"))  # the form's script runs

    page.get_by_label("Or upload a Hugging Face Llama folder").set_input_files(sorted(folder.iterdir()))
    expect(page.locator("#f-model-files-status")).to_have_text("Uploaded llama-2x64 · 2 layers · dim 64 · vocab 512.")
    model = off_loop(lambda: PretrainedModel.objects.get(owner=alice))
    expect(start_from).to_have_value(str(model.pk))
    expect(start_from.locator("option:checked")).to_have_text("llama-2x64 · 2 layers · dim 64 · vocab 512")
    page.screenshot(path=str(tmp_path / "launch-pretrained.png"), full_page=True)

    page.locator("summary", has_text="Custom model sizes").click()
    page.get_by_label("Sequence length").fill("32")
    page.get_by_role("button", name="Launch run").click()
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    run = off_loop(lambda: Run.objects.get(owner=alice))
    assert run.pretrained_id == model.pk
    assert (run.spec["model"]["dim"], run.spec["model"]["seq_len"], run.spec["data"]["pretrained"]) == (64, 32, model.path)
    console.assert_clean()
