"""What the dashboard shows is what the API says, live: every value follows the events the page
already receives, so no view disagrees with the API after the first update and none needs a
reload. Events arrive as a node agent's would (`do_ingest_events`, the ingest endpoint's own
code) or as the control plane records them; the web process, the Celery worker, the database
and the browser are real."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from deployments.models import Deployment, Replica
from runs import services
from runs.models import Checkpoint, Run
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot
from tests.e2e.test_live_updates import create_run

pytestmark = pytest.mark.browser

SCREENS = Path("/tmp/fathom-notes/screens")


class Agent:
    """Posts events as node agent `source` does: numbered per source, through the ingest code."""

    def __init__(self, run: Run, source: str = "node-0") -> None:
        self.run = run
        self.source = source
        self.seq = 0

    def send(self, kind: str, data: dict | None = None) -> None:
        self.seq += 1
        event = {"seq": self.seq, "kind": kind, "data": data or {}}
        off_loop(lambda: services.do_ingest_events(self.run, self.source, [event]))

    def beat(self) -> None:
        """An empty batch, as an idle agent's reporter posts."""
        off_loop(lambda: services.do_ingest_events(self.run, self.source, []))


def committed_checkpoint(run: Run, step: int) -> Path:
    folder = off_loop(lambda: Run.objects.get(pk=run.pk).folder) / "checkpoints" / f"step_{step:08d}"
    folder.mkdir(parents=True)
    (folder / "COMMITTED").write_text(f"{step}\n")
    return folder


def save_screens(page: Page, name: str) -> None:
    SCREENS.mkdir(parents=True, exist_ok=True)
    shutil.copy(screenshot(page, name), SCREENS / name)


@pytest.mark.django_db(transaction=True)
def test_a_run_page_opened_before_the_run_starts_follows_it_to_succeeded_without_a_reload(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    run = create_run(alice, "followed from the start", {"train": {"steps": 30, "keep_checkpoints": 1}})
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    badge = page.locator("#run-status")
    expect(badge).to_have_attribute("data-status", "queued")
    expect(page.locator("#live-state")).to_have_attribute("data-state", "live")

    agent = Agent(run)
    agent.send("agent_started", {"node": 0, "host": "node-a", "nproc": 1})
    agent.send("rendezvous", {"attempt": 0, "host": "node-a", "ranks": [0], "world_size": 1})
    expect(badge).to_have_attribute("data-status", "starting")
    agent.send("metrics", {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 800.0})
    expect(badge).to_have_attribute("data-status", "running")
    expect(page.locator('#timeline li[data-kind="status"]').first).to_contain_text("Status: running")

    # A checkpoint appears as a row; the next one prunes it (keep_checkpoints=1): marked, no Deploy.
    first = committed_checkpoint(run, 10)
    agent.send("checkpoint", {"step": 10, "path": str(first)})
    row10 = page.locator('#checkpoint-rows tr[data-step="10"]')
    expect(row10).to_have_attribute("data-state", "saved")
    expect(row10.get_by_role("button", name="Deploy…")).to_be_visible()
    shutil.rmtree(first)  # as the trainer prunes, before it reports the checkpoint that replaced it
    final = committed_checkpoint(run, 20)
    agent.send("checkpoint", {"step": 20, "path": str(final)})
    expect(row10).to_have_attribute("data-state", "pruned")
    expect(row10.get_by_role("button")).to_have_count(0)
    assert off_loop(lambda: Checkpoint.objects.get(run=run, step=10).pruned_at) is not None

    # A node agent that stops posting is shown as silent, and no longer once it posts again.
    silent = page.locator("#silent-nodes")
    expect(silent).to_be_hidden()
    off_loop(lambda: services.do_mark_silent_nodes(run, silent_after=0.0))
    expect(silent).to_be_visible()
    expect(silent).to_have_text("node-0 silent")
    agent.beat()
    expect(silent).to_be_hidden()
    expect(page.locator('#timeline li[data-kind="node_reporting"]')).to_be_visible()

    agent.send("metrics", {"step": 30, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 900.0})
    # The loss chart smooths and goes logarithmic on request, and says its latest value unhovered.
    loss = page.locator("#chart-loss")
    expect(loss.locator(".u-legend")).to_contain_text("3")
    page.get_by_label("Smoothing").fill("0.6")
    expect(loss).to_have_attribute("data-smoothing", "0.6")
    expect(page.locator("#loss-smoothing-value")).to_have_text("0.60")
    page.get_by_label("log scale").check()
    expect(loss).to_have_attribute("data-scale", "log")
    expect(loss).to_have_attribute("data-points", "2")
    # Hover is synced: the step under the cursor on the loss chart is the one every chart shows.
    step_on = lambda chart: page.locator(f"#{chart} .u-legend .u-series").first.locator(".u-value")  # noqa: E731
    expect(step_on("chart-lr")).to_have_text("30")  # unhovered: the latest point
    box = loss.locator(".u-over").bounding_box()
    page.mouse.move(box["x"] + 2, box["y"] + box["height"] / 2)
    expect(step_on("chart-lr")).to_have_text("1")
    expect(step_on("chart-tps")).to_have_text("1")
    page.mouse.move(0, 0)
    agent.send("succeeded", {"step": 20})
    expect(badge).to_have_attribute("data-status", "succeeded")
    expect(page.locator("#live-state")).to_have_text("final")
    expect(page.get_by_role("button", name="Cancel")).to_be_hidden()

    # The export the success starts (here: recorded as the export task records it) fills the row.
    row20 = page.locator('#checkpoint-rows tr[data-step="20"]')
    expect(row20).to_have_attribute("data-state", "saved")
    export = str(final.parent.parent / "exports" / "step_00000020")
    off_loop(lambda: Checkpoint.objects.filter(run=run, step=20).update(export_path=export))
    off_loop(lambda: services.do_record_event(run, "exported", {"step": 20, "path": export}))
    expect(row20).to_have_attribute("data-state", "exported")
    expect(row20).to_contain_text(export)

    # What the page shows is what the API says.
    api_run = page.evaluate(f"fetch('/api/runs/{run.pk}/').then(r => r.json())")
    assert api_run["status"] == badge.get_attribute("data-status") == "succeeded"
    save_screens(page, "desktop-run-followed.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_a_pruned_checkpoint_that_was_never_exported_cannot_be_deployed(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    console.allow_http_error("/api/deployments/", 400)
    run = create_run(alice, "pruned", {}, status="running")
    checkpoint = off_loop(lambda: Checkpoint.objects.create(run=run, step=5, path="/nowhere/step_00000005", pruned_at=timezone.now()))
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    answer = page.evaluate(
        """(id) => fetch('/api/deployments/', {method: 'POST', headers: {'Content-Type': 'application/json',
             'X-CSRFToken': document.cookie.match(/csrftoken=([^;]+)/)[1]}, body: JSON.stringify({checkpoint: id})})
           .then(async r => [r.status, await r.json()])""",
        checkpoint.pk,
    )
    assert answer[0] == 400
    assert "deleted by the trainer (train.keep_checkpoints)" in answer[1]["checkpoint"][0]
    # Its row says so and offers no Deploy.
    row = page.locator('#checkpoint-rows tr[data-step="5"]')
    expect(row).to_have_attribute("data-state", "pruned")
    expect(row.get_by_role("button")).to_have_count(0)
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_a_stopped_deployments_replicas_show_as_stopped_and_a_starting_one_shows_its_phase(
    alice, live_web, celery_worker, browser_page: Page, console: ConsoleWatch
):
    run = create_run(alice, "served", {}, status="succeeded")
    checkpoint = off_loop(lambda: Checkpoint.objects.create(run=run, step=30, path="/nowhere"))

    def make() -> Deployment:
        deployment = Deployment.objects.create(
            owner=alice, name="served", checkpoint=checkpoint, served_model_name="served-step30",
            status=Deployment.Status.STARTING, replicas=2,
        )
        for index in range(2):
            Replica.objects.create(deployment=deployment, index=index)
        return deployment

    deployment = off_loop(make)
    logs = deployment.folder / "logs"
    logs.mkdir(parents=True)
    (logs / "replica-0.log").write_text("INFO Resolved architecture: LlamaForCausalLM\nINFO Loading weights took 0.41 seconds\n")
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/deployments/{deployment.pk}")
    expect(page.locator("#startup")).to_be_visible()
    expect(page.locator("#startup-phase")).to_have_attribute("data-phase", "weights")
    expect(page.locator("#startup-log")).to_contain_text("Loading weights took 0.41 seconds")
    expect(page.get_by_role("button", name="Send")).to_be_disabled()

    # The supervisor's events, as sync stores them: the cards follow without a reload.
    def ready() -> None:
        from deployments import services as deployment_services

        Replica.objects.filter(deployment=deployment).update(status=Replica.Status.READY, url="http://127.0.0.1:9", updated_at=timezone.now())
        for index in range(2):
            deployment_services.do_record(deployment, "replica_ready", {"replica": index, "url": "http://127.0.0.1:9"})
        Deployment.objects.filter(pk=deployment.pk).update(status=Deployment.Status.READY)
        deployment_services.do_record(deployment, "status", {"status": "ready", "ready": 2, "replicas": 2})

    off_loop(ready)
    cards = page.locator("#replica-grid li")
    expect(cards.nth(0)).to_have_attribute("data-state", "ready")
    expect(cards.nth(1)).to_have_attribute("data-state", "ready")
    expect(cards.nth(0)).to_contain_text("ready since")
    expect(page.locator("#startup")).to_be_hidden()
    expect(page.get_by_role("button", name="Send")).to_be_enabled()

    # Stop, confirmed: the real stop task runs in the worker; both replicas end as stopped.
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Stop").click()
    expect(page.locator("#deployment-status")).to_have_attribute("data-status", "stopped", timeout=60_000)
    expect(cards.nth(0)).to_have_attribute("data-state", "stopped")
    expect(cards.nth(1)).to_have_attribute("data-state", "stopped")
    expect(page.get_by_role("button", name="Send")).to_be_disabled()
    expect(page.locator("#chat-closed")).to_be_visible()
    rows = off_loop(lambda: list(Replica.objects.filter(deployment=deployment).values_list("status", flat=True)))
    assert rows == ["stopped", "stopped"]
    page.reload()  # and the same after a reload, from the rows
    expect(cards.nth(0)).to_have_attribute("data-state", "stopped")
    expect(page.locator('#timeline li[data-kind="stopped"]')).to_be_visible()  # the history, replayed
    save_screens(page, "desktop-deployment-stopped.png")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_check_layout_shows_the_specs_own_error_for_a_tp_the_model_refuses(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    page = browser_page
    console.allow_http_error("/api/runs/check/", 400)
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/new")
    page.get_by_label("Tensor parallel (tp)", exact=True).fill("3")
    page.get_by_role("button", name="Check layout").click()
    error = page.locator('[data-error-for="spec.layout.tp"]')
    expect(error).to_have_text("must divide model.n_heads; got tp=3, n_heads=4")
    expect(page.locator("#plan-result")).to_contain_text("This run would not launch")
    expect(page.locator("#plan-result table")).to_have_count(0)  # no ranking of a layout that cannot run

    # Fixed, the check ranks it; layouts with the same step time share their rank.
    page.get_by_label("Tensor parallel (tp)", exact=True).fill("2")
    page.get_by_role("button", name="Check layout").click()
    expect(page.locator("#plan-result")).to_contain_text("Your layout (dp1 tp2 pp1")
    ranks = [int(r) for r in page.locator("#plan-result tbody tr").evaluate_all("rows => rows.map(r => r.dataset.rank)")]
    assert ranks == sorted(ranks) and ranks[0] == 1
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_clone_opens_the_launch_form_filled_in_from_the_run(alice, live_web, browser_page: Page, console: ConsoleWatch):
    page = browser_page
    run = create_run(alice, "original", {"layout": {"dp": 2}, "train": {"steps": 42, "lr": 0.002}}, status="succeeded")
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    page.get_by_role("link", name="Clone…").click()
    expect(page.get_by_role("heading", name=f"Clone run #{run.pk}")).to_be_visible()
    assert page.url == f"{live_web.url}/runs/new?from={run.pk}"
    expect(page.get_by_label("Name", exact=True)).to_have_value("original (clone)")
    expect(page.get_by_label("Data parallel (dp)", exact=True)).to_have_value("2")
    expect(page.get_by_label("Steps", exact=True)).to_have_value("42")
    assert off_loop(lambda: Run.objects.count()) == 1  # nothing started yet

    page.get_by_label("Steps", exact=True).fill("50")
    page.get_by_role("button", name="Launch run").click()
    expect(page.get_by_role("heading", name="original (clone)")).to_be_visible()
    clone = off_loop(lambda: Run.objects.get(name="original (clone)"))
    source = off_loop(lambda: Run.objects.get(pk=run.pk))
    assert clone.spec["train"]["steps"] == 50
    assert {k: v for k, v in clone.spec["train"].items() if k != "steps"} == {
        k: v for k, v in source.spec["train"].items() if k != "steps"
    }
    assert clone.spec["layout"] == source.spec["layout"]
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_no_page_scrolls_sideways_on_a_phone(alice, live_web, browser_page: Page, console: ConsoleWatch):
    page = browser_page
    run = create_run(alice, "a run with a rather long name for a phone", {"layout": {"dp": 2}}, status="running")
    Agent(run).send("metrics", {"step": 1, "loss": 5.0, "lr": 1e-3, "tokens_per_s": 800.0})
    export = "/var/lib/fathom/runs/1-20261201-120000-000000/exports/step_00000010"
    off_loop(lambda: Checkpoint.objects.create(run=run, step=10, path="/nowhere", export_path=export))
    checkpoint = off_loop(lambda: Checkpoint.objects.get(run=run, step=10))
    deployment = off_loop(
        lambda: Deployment.objects.create(
            owner=alice, name="phone", checkpoint=checkpoint, served_model_name="a-rather-long-served-model-name-step10",
            status=Deployment.Status.READY,
        )
    )
    off_loop(lambda: Replica.objects.create(deployment=deployment, index=0, status="ready", url="http://127.0.0.1:43123"))

    def fits(path: str, name: str) -> None:
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"{path} scrolls sideways by {overflow} px on a phone"
        save_screens(page, name)

    for width, height, prefix in ((390, 844, "phone"), (1366, 900, "desktop")):
        page.set_viewport_size({"width": width, "height": height})
        page.context.clear_cookies()
        page.goto(f"{live_web.url}/login/")
        fits("/login/", f"{prefix}-login.png")
        log_in(page, live_web.url, "alice", "alice-password-1")
        fits("/", f"{prefix}-runs.png")
        page.goto(f"{live_web.url}/runs/new")
        expect(page.locator("#f-dataset option").first).to_be_attached()
        page.get_by_label("Data parallel (dp)", exact=True).fill("2")
        page.get_by_role("button", name="Check layout").click()
        expect(page.locator("#plan-result tbody tr").first).to_be_visible()
        fits("/runs/new (layout check)", f"{prefix}-launch-form-checked.png")
        page.goto(f"{live_web.url}/runs/new?from={run.pk}")
        expect(page.get_by_label("Name", exact=True)).to_have_value(f"{run.name} (clone)")
        fits("/runs/new?from=", f"{prefix}-clone-form.png")
        page.goto(f"{live_web.url}/runs/{run.pk}")
        expect(page.locator('#checkpoint-rows tr[data-state="exported"]')).to_be_visible()
        fits(f"/runs/{run.pk}", f"{prefix}-run-page.png")
        page.locator('#checkpoint-rows tr[data-step="10"]').get_by_role("button", name="Deploy…").click()
        expect(page.locator("#deploy-dialog")).to_be_visible()
        expect(page.get_by_label("Name", exact=True)).to_have_value(f"{run.name} step 10")
        fits("deploy dialog", f"{prefix}-deploy-dialog.png")
        page.locator("#deploy-cancel").click()
        page.goto(f"{live_web.url}/deployments")
        expect(page.locator(f'#deployment-rows tr[data-deployment-id="{deployment.pk}"]')).to_be_visible()
        fits("/deployments", f"{prefix}-deployments.png")
        page.goto(f"{live_web.url}/deployments/{deployment.pk}")
        expect(page.locator('#replica-grid li[data-state="ready"]')).to_be_visible()
        fits(f"/deployments/{deployment.pk}", f"{prefix}-deployment.png")
        if prefix == "phone":
            # The playground comes before the charts on a phone: within the first two screens.
            top = page.locator("#chat-title").evaluate("el => el.getBoundingClientRect().top + window.scrollY")
            assert top < 2 * height, f"the playground starts {top} px down"
    console.assert_clean()
