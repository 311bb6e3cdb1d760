"""A run waiting in Slurm's queue, seen and cancelled from its page, on a real one-machine Slurm
cluster (tools/slurm_cluster.py) with a real web process, Celery worker and beat.

The node has 2 CPUs and a dp2 run's job asks for both: a second run waits in Slurm's queue
while the first runs, and its page says why, in Slurm's words, as it changes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from runs.models import Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot
from tests.e2e.test_run_pages import fill_in
from tests.platform.test_run_lifecycle import api, wait_until
from tests.platform.test_slurm import DP2, job_field, squeue_ids
from training.run_dir import CheckpointDir

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def cancel_from_the_page(page: Page, server_url: str, run_id: int) -> None:
    page.goto(f"{server_url}/runs/{run_id}")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel").click()


@pytest.mark.django_db(transaction=True)
def test_a_run_waiting_in_the_slurm_queue_shows_slurms_reason_and_both_jobs_stop_on_cancel(
    slurm, alice, live_web, celery_worker_with_beat, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    client = off_loop(lambda: api(live_web, alice))
    long = {"layout": {"dp": 2}, "train": {"steps": 2000, "checkpoint_interval": 2, "global_batch": 4}}
    first = client.post("/api/runs/", json={"name": "holds the node", "spec": long}).json()["id"]
    wait_until(lambda: client.get(f"/api/runs/{first}/checkpoints/").json(), 300, "the first run's first checkpoint")
    second = client.post("/api/runs/", json={"name": "waits", "spec": DP2}).json()["id"]

    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{second}")
    # The page shows Slurm's reason once the watch has read squeue (a `waiting` event).
    wait_until(lambda: client.get(f"/api/runs/{second}/").json()["slurm_job_id"].isdigit(), 60, "the second job")
    second_job = client.get(f"/api/runs/{second}/").json()["slurm_job_id"]
    reason = page.locator("#run-reason")
    expect(reason).to_have_text(
        f"waiting: Slurm job {second_job} pending, 1st in partition debug: "
        "waiting for resources (the nodes it needs are busy) (Resources)",
        timeout=60_000,
    )
    expect(page.locator("#run-status")).to_have_attribute("data-status", "queued")
    expect(page.locator('#timeline li[data-kind="waiting"]', has_text=f"submitted to Slurm as job {second_job}")).to_be_visible()
    screenshot(page, "slurm-run-waiting.png")
    assert job_field(slurm, second_job, "JobState") == "PENDING"

    # Cancelling the waiting run takes its job out of Slurm's queue at once.
    cancel_from_the_page(page, live_web.url, second)
    expect(page.locator("#run-status")).to_have_attribute("data-status", "cancelled")
    wait_until(lambda: second_job not in squeue_ids(slurm), 30, "the second job to leave the queue")

    # Cancelling the running one: its agents stop the ranks cleanly and the job ends by itself.
    first_job = client.get(f"/api/runs/{first}/").json()["slurm_job_id"]
    cancel_from_the_page(page, live_web.url, first)
    expect(page.locator("#run-status")).to_have_attribute("data-status", "cancelled", timeout=120_000)
    wait_until(lambda: first_job not in squeue_ids(slurm), 60, "the first job to leave the queue")
    checkpoints = client.get(f"/api/runs/{first}/checkpoints/").json()
    assert checkpoints and CheckpointDir(Path(checkpoints[-1]["path"])).is_committed
    run = off_loop(lambda: Run.objects.get(pk=first))
    assert off_loop(lambda: run.events.filter(kind="cancelled", source="node-0").exists())  # the agent's own outcome
    # The job ended by itself, with the agent's exit status for "cancelled", not by scancel.
    assert (job_field(slurm, first_job, "JobState"), job_field(slurm, first_job, "ExitCode")) == ("FAILED", "3:0")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_the_launch_form_takes_a_runs_slurm_options_and_shows_a_bad_one_next_to_its_input(
    slurm, alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    console.allow_http_error("/api/runs/", 400)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.get_by_role("link", name="New run").first.click()
    fill_in(page, "Name", "with options")
    page.locator("summary", has_text="Slurm").click()
    fill_in(page, "Partition", "debug")
    fill_in(page, "Time limit", "an hour")
    page.get_by_role("button", name="Launch run").click()
    expect(page.locator('[data-error-for="slurm.time_limit"]')).to_contain_text("must be a Slurm time limit")
    assert page.locator(".field-error:not([hidden])").count() == 1

    fill_in(page, "Time limit", "1-12:00")
    fill_in(page, "GPUs per node", "0")
    page.get_by_role("button", name="Launch run").click()
    page.wait_for_url(re.compile(r"/runs/\d+$"))
    run = off_loop(lambda: Run.objects.get(name="with options"))
    assert run.slurm == {"partition": "debug", "account": "", "qos": "", "time_limit": "1-12:00", "gpus_per_node": 0}
    console.assert_clean()
