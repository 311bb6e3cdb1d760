"""A trained checkpoint is deployed from its run's page and answers in the playground, token by
token, through Fathom's chat endpoint and a real vLLM replica."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import Page, expect
from rest_framework.authtoken.models import Token

from deployments import supervision
from deployments.models import Deployment
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot
from tests.e2e.test_run_pages import STORY

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.vllm]

# Training, export and a vLLM replica's start on a shared CPU take minutes; these only stop hangs.
EXPORT_TIMEOUT_MS = 600_000
REPLICA_TIMEOUT_MS = 900_000
ANSWER_TIMEOUT_MS = 120_000


def trained_run(server_url: str, token: str) -> int:
    """A tiny run through the API (the form has its own test); returns its id."""
    api = httpx.Client(base_url=server_url, headers={"Authorization": f"Token {token}"}, timeout=30)
    dataset = api.post("/api/datasets/", files={"file": ("stories.txt", STORY.encode())}).json()
    spec = {"train": {"steps": 8, "warmup_steps": 2, "checkpoint_interval": 8}}
    created = api.post("/api/runs/", json={"name": "to serve", "dataset": dataset["id"], "spec": spec})
    assert created.status_code == 201, created.text
    return int(created.json()["id"])


@pytest.mark.django_db(transaction=True)
def test_a_checkpoint_deployed_from_the_run_page_streams_its_answer_in_the_playground(
    alice, live_web, celery_worker_with_beat, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    token = off_loop(lambda: Token.objects.get_or_create(user=alice)[0].key)
    run_id = trained_run(live_web.url, token)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run_id}")
    final = page.locator('#checkpoint-rows tr[data-step="8"]')
    expect(final).to_have_attribute("data-state", "exported", timeout=EXPORT_TIMEOUT_MS)

    final.get_by_role("button", name="Deploy…").click()  # asks for a name, replicas and options first
    expect(page.get_by_label("Replicas")).to_have_value("1")
    page.locator("#deploy-confirm").click()
    page.wait_for_url(f"{live_web.url}/deployments/*")
    deployment_id = int(page.url.rsplit("/", 1)[1])
    try:
        replica = page.locator('#replica-grid li[data-replica="0"]')
        # While it starts, the page says for how long and what vLLM is doing, from its log.
        expect(page.locator("#startup")).to_be_visible()
        expect(page.locator("#startup-log")).to_contain_text("fathom: starting replica 0", timeout=REPLICA_TIMEOUT_MS)
        expect(replica).to_have_attribute("data-state", "ready", timeout=REPLICA_TIMEOUT_MS)
        expect(page.locator("#startup")).to_be_hidden()
        expect(page.locator("#deployment-status")).to_have_attribute("data-status", "ready")
        expect(page.locator('#timeline li[data-kind="replica_ready"]')).to_contain_text("Replica 0 ready")

        page.get_by_label("Key name").fill("laptop")
        page.get_by_role("button", name="Create key").click()
        expect(page.locator("#new-key-value")).to_contain_text("fth-")
        expect(page.locator("#key-list li")).to_contain_text("laptop")

        page.get_by_label("Max tokens").fill("12")
        page.get_by_label("Temperature").fill("0")
        page.get_by_label("Message").fill("Ada walked to the")
        page.get_by_label("Message").press("Enter")
        answer = page.locator(".msg-assistant")
        expect(answer).to_have_attribute("data-streaming", "false", timeout=ANSWER_TIMEOUT_MS)
        expect(page.locator("#chat-error")).to_be_hidden()
        assert answer.inner_text().strip()
        assert int(answer.get_attribute("data-pieces") or 0) > 1  # it arrived as a stream of pieces
        expect(page.locator("#chat-stats")).to_contain_text("finished")
        # The page's default dtype on a CPU with AMX is bfloat16, whose attention runs AMX tiles:
        # the replica answered its first requests (the supervisor's warm-up token, then this
        # chat) without dying (its worker once died of SIGILL on the first one).
        expect(page.locator('#timeline li[data-kind="replica_died"]')).to_have_count(0)
        assert off_loop(lambda: Deployment.objects.get(pk=deployment_id).replica_set.get().restarts) == 0
        # Serving metrics keep arriving live (one sample per sync, every second in tests).
        tokens_per_s = page.locator("#chart-dtps")
        held = int(tokens_per_s.get_attribute("data-points") or 0)
        page.wait_for_function(
            f"() => Number(document.getElementById('chart-dtps').dataset.points) >= {held + 3}",
            timeout=ANSWER_TIMEOUT_MS,
        )
        # Each replica's card shows its prefix-cache hit rate from vLLM's own counters, which
        # the chat (and the supervisor's one-token probes) fed.
        expect(replica.locator(".cache-hits")).to_have_text(re.compile(r"^prefix cache hits \d+ %$"))
        screenshot(page, "deployment-playground.png")

        page.once("dialog", lambda dialog: dialog.accept())
        page.get_by_role("button", name="Stop").click()
        expect(page.locator("#deployment-status")).to_have_attribute(
            "data-status", "stopped", timeout=REPLICA_TIMEOUT_MS
        )
        expect(replica).to_have_attribute("data-state", "stopped")
        expect(page.get_by_role("button", name="Send")).to_be_disabled()
    finally:
        # Never leave a replica running past the test, whatever failed above.
        deployment = off_loop(lambda: Deployment.objects.get(pk=deployment_id))
        off_loop(lambda: supervision.stop(deployment))
    console.assert_clean()
