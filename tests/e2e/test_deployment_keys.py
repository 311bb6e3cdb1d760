"""The deployment page's keys card: a key is made with a rate limit, shown once, used from outside
with the official `openai` client (its use appears on the page), limited, and revoked."""

from __future__ import annotations

import openai
import pytest
from playwright.sync_api import Page, expect

from deployments.models import Deployment
from runs.models import Checkpoint, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot

pytestmark = [pytest.mark.browser]

# The page reads its keys every 5 s; use reaches the database within deployments.usage.FLUSH_S.
USE_SHOWN_MS = 15_000


def ready_deployment(owner) -> int:
    """A deployment as the API shows it once ready; /v1/models answers for it without a replica."""
    run = Run.objects.create(owner=owner, name="served", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=4, path="/nowhere")
    deployment = Deployment.objects.create(
        owner=owner, name="served", checkpoint=checkpoint, served_model_name="served-model", status="ready"
    )
    return deployment.pk


@pytest.mark.django_db(transaction=True)
def test_a_key_is_made_used_limited_and_revoked_from_the_deployment_page(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    deployment_id = off_loop(lambda: ready_deployment(alice))
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/deployments/{deployment_id}")
    expect(page.locator("#key-none")).to_be_visible()
    # Where and what to call, before any key exists.
    expect(page.locator("#call-base-url")).to_have_text(f"{live_web.url}/v1")
    expect(page.locator("#call-model")).to_have_text("served-model")

    page.get_by_label("Key name").fill("ci")
    page.get_by_label("Requests per minute").fill("2")
    page.get_by_role("button", name="Create key").click()
    secret_box = page.locator("#new-key-value")
    expect(secret_box).to_contain_text("fth-")
    secret = secret_box.text_content() or ""
    # The examples now carry the new key, this server's /v1 and the model.
    expect(page.locator("#call-example")).to_contain_text(f'base_url="{live_web.url}/v1", api_key="{secret}"')
    expect(page.locator("#call-example")).to_contain_text('model="served-model"')
    expect(page.locator("#call-example-curl")).to_contain_text(f"Bearer {secret}")

    row = page.locator(f'#key-list li[data-prefix="{secret[:12]}"]')
    expect(row).to_contain_text("ci")
    expect(row.locator('[data-use="requests"]')).to_have_text("0 requests")
    expect(row.locator('[data-use="limit"]')).to_have_text("2 requests/min")
    expect(row.locator('[data-use="last-used"]')).to_have_text("never")
    expect(page.locator("#key-none")).to_be_hidden()

    client = openai.OpenAI(base_url=f"{live_web.url}/v1", api_key=secret, max_retries=0, timeout=30)
    for _ in range(2):
        assert [m.id for m in client.models.list().data] == ["served-model"]
    expect(row.locator('[data-use="requests"]')).to_have_text("2 requests", timeout=USE_SHOWN_MS)
    expect(row.locator('[data-use="last-used"]')).not_to_have_text("never")
    with pytest.raises(openai.RateLimitError):
        client.models.list()
    screenshot(page, "deployment-keys.png")

    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name=f"Revoke {secret[:12]}…").click()
    expect(row).to_have_attribute("data-revoked", "true")
    expect(row).to_contain_text("revoked")
    with pytest.raises(openai.AuthenticationError):  # this web process forgets a revoked key at once
        client.models.list()
    console.assert_clean()
