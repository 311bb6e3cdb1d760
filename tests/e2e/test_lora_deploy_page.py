"""A LoRA run's checkpoint on the run page: the deploy form offers it merged into its base or
attached to one of the user's deployments of that base, and attaching lands on that deployment's
page, which lists the adapter. The rows are written as the API writes them (the replicas that
load an adapter are tests/platform/test_v1_served.py's); the web process, the database and the
browser are real."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from deployments.models import Adapter, Deployment
from runs.models import Checkpoint, PretrainedModel, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop

pytestmark = pytest.mark.browser


@pytest.mark.django_db(transaction=True)
def test_a_lora_checkpoint_deploys_merged_or_attaches_to_a_deployment_of_its_base(
    alice, live_web, browser_page: Page, console: ConsoleWatch, tmp_path: Path
):
    page = browser_page
    base = off_loop(lambda: PretrainedModel.objects.create(owner=alice, name="small llama", path=str(tmp_path)))
    lora = {"lora": {"rank": 8, "alpha": 16.0}, "model": {"seq_len": 64}, "train": {"steps": 6}}
    run = off_loop(lambda: Run.objects.create(owner=alice, name="tuned", spec=lora, status="succeeded", pretrained=base))
    folder = tmp_path / "step-6"
    folder.mkdir()
    off_loop(lambda: Checkpoint.objects.create(run=run, step=6, path=str(folder)))
    served = off_loop(lambda: Deployment.objects.create(
        owner=alice, name="base", pretrained=base, served_model_name="small-base", status="ready",
        options={"max_loras": 2, "max_lora_rank": 8, "max_model_len": 64},
    ))  # fmt: skip
    off_loop(lambda: Deployment.objects.create(  # LoRA off: not offered
        owner=alice, name="plain", pretrained=base, served_model_name="plain-base", status="ready", options={},
    ))  # fmt: skip

    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    page.locator('#checkpoint-rows tr[data-step="6"]').get_by_role("button", name="Deploy…").click()
    how = page.get_by_label("Serve", exact=True)
    expect(how.locator("option")).to_have_text(
        ["merged into its base, as a deployment of its own", "as an adapter on small-base"]
    )
    expect(page.locator("#deploy-quantization option")).to_have_text(["none (merged export)"])
    expect(page.get_by_label("Replicas", exact=True)).to_be_visible()

    how.select_option(label="as an adapter on small-base")
    expect(page.get_by_label("Replicas", exact=True)).to_be_hidden()
    expect(page.get_by_label("Name", exact=True)).to_have_value("tuned-step6")
    page.get_by_label("Name", exact=True).fill("support-bot")
    page.get_by_role("button", name="Deploy", exact=True).click()

    page.wait_for_url(f"{live_web.url}/deployments/{served.pk}")
    expect(page.locator("#adapter-list li")).to_have_text(["support-bot · tuned, step 6"])
    assert off_loop(lambda: list(Adapter.objects.values_list("deployment_id", "name"))) == [(served.pk, "support-bot")]
