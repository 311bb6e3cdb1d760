"""The run and deployment pages stay true after a host is lost: the ranks and replicas that went
with it are shown as lost with it, failures stay on the rank that reported them, the layout is
the one the run has now. Events arrive as the node agents and the control plane record them
(the agents' through the ingest code; the deployment's loss through `supervision.lose_hosts`
itself); the web process, the database and the browser are real."""

from __future__ import annotations

import pytest
from django.utils import timezone
from playwright.sync_api import Page, expect

from deployments import services as deployment_services
from deployments import supervision
from deployments.models import Deployment, Replica
from hosts.models import DeviceClaim, Host
from runs import services
from runs.models import Checkpoint
from tests.e2e.conftest import ConsoleWatch, log_in, off_loop, screenshot
from tests.e2e.test_live_updates import create_run
from tests.e2e.test_truthful_pages import Agent

pytestmark = pytest.mark.browser


@pytest.mark.django_db(transaction=True)
def test_after_losing_node_1s_host_the_run_page_shows_its_rank_lost_there_and_the_layout_it_has_now(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    spec = {"layout": {"dp": 2}, "nodes": {"min": 1, "max": 2, "nproc_per_node": 1}}
    run = create_run(alice, "shrinks", spec, status="running")
    node0, node1 = Agent(run, "node-0"), Agent(run, "node-1")
    node0.send("rendezvous", {"round": 0, "node": 0, "host": "hA", "nodes": 2, "world_size": 2, "ranks": [0]})
    node1.send("rendezvous", {"round": 0, "node": 1, "host": "hB", "nodes": 2, "world_size": 2, "ranks": [1]})
    for step in (1, 2, 3):
        node0.send("metrics", {"step": step, "loss": 6.0 - 0.1 * step, "lr": 1e-3, "tokens_per_s": 900.0, "mfu": 0.1})

    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/runs/{run.pk}")
    rank0, rank1 = page.locator('#rank-grid li[data-rank="0"]'), page.locator('#rank-grid li[data-rank="1"]')
    expect(rank1).to_have_attribute("data-state", "running")
    expect(rank1).to_contain_text("hB")
    expect(page.locator("#stat-layout")).to_have_text("2×1×1")

    # hB goes dark: node 0's rank finds its collective broken and exits; its agent re-forms the
    # job alone (nodes.min=1), and the control plane marks hB lost a few seconds later.
    node0.send("rank_failed", {"rank": 0, "host": "hA", "reason": "exited", "exit_code": 1, "signal": None, "last_step": 3})
    node0.send("restarting", {"attempt": 1, "from_step": 2, "reason": "rank failed", "restarts_left": 2})
    node0.send("node_lost", {"nodes_before": 2, "nodes": 1})
    node0.send("rendezvous", {"round": 1, "node": 0, "host": "hA", "nodes": 1, "world_size": 1, "ranks": [0]})
    off_loop(lambda: services.do_record_event(run, "host_lost", {
        "host": "hB", "address": "10.0.0.12", "nodes": ["node-1"], "nodes_left": 1, "continues": True,
    }))  # fmt: skip

    expect(page.locator("#stat-layout")).to_have_text("1×1×1 (planned 2×1×1)")
    expect(rank0).to_have_attribute("data-state", "running")
    expect(rank0).to_contain_text("hA")
    expect(rank0).to_contain_text("1 failure: exited (exit 1)")
    expect(rank1).to_have_attribute("data-state", "lost")
    expect(rank1).to_contain_text("host lost")
    expect(rank1).to_contain_text("1 failure: host hB lost")
    expect(rank1).to_contain_text("not in the 1-rank world")
    expect(page.locator('#timeline li[data-kind="rendezvous"]').first).to_contain_text("round 1: node 0 on hA, ranks 0 of 1")
    expect(page.locator('#timeline li[data-kind="host_lost"]')).to_contain_text("node-1 gone; 1 node left, the run goes on")
    screenshot(page, "run-page-after-host-loss.png")

    page.reload()  # the same from the replayed history
    expect(page.locator("#stat-layout")).to_have_text("1×1×1 (planned 2×1×1)")
    expect(rank1).to_have_attribute("data-state", "lost")
    expect(rank0).to_have_attribute("data-failures", "1")
    console.assert_clean()


@pytest.mark.django_db(transaction=True)
def test_after_losing_one_host_the_deployment_page_shows_its_replica_lost_there_and_the_other_serving(
    alice, live_web, browser_page: Page, console: ConsoleWatch
):
    run = create_run(alice, "served", {}, status="succeeded")

    def make() -> Deployment:
        checkpoint = Checkpoint.objects.create(run=run, step=30, path="/nowhere")
        deployment = Deployment.objects.create(
            owner=alice, name="spread", checkpoint=checkpoint, served_model_name="spread",
            status=Deployment.Status.READY, replicas=2,
        )  # fmt: skip
        for index in range(2):
            host = Host.objects.create(name=f"h{index}", address=f"10.0.0.1{index}", devices=[{"index": 0, "kind": "cpu"}])
            DeviceClaim.objects.create(host=host, device=0, deployment=deployment, node=index)
            Replica.objects.create(
                deployment=deployment, index=index, status=Replica.Status.READY, url=f"http://10.0.0.1{index}:28400"
            )
            deployment_services.do_record(deployment, "replica_ready", {"replica": index, "url": f"http://10.0.0.1{index}:28400"})
        return deployment

    deployment = off_loop(make)
    page = browser_page
    log_in(page, live_web.url, "alice", "alice-password-1")
    page.goto(f"{live_web.url}/deployments/{deployment.pk}")
    cards = page.locator("#replica-grid li")
    expect(cards.nth(0)).to_have_attribute("data-state", "ready")
    expect(cards.nth(1)).to_have_attribute("data-state", "ready")

    def lose_h0() -> None:
        Host.objects.filter(name="h0").update(status=Host.Status.LOST)
        supervision.lose_hosts(Deployment.objects.get(pk=deployment.pk))

    off_loop(lose_h0)
    expect(page.locator("#deployment-status")).to_have_attribute("data-status", "degraded")
    expect(page.locator("#deployment-reason")).to_have_text("host h0 was lost with replica 0")
    expect(cards.nth(0)).to_have_attribute("data-state", "dead")
    expect(cards.nth(0)).to_contain_text("lost with host h0; waiting for a host with room")
    expect(cards.nth(1)).to_have_attribute("data-state", "ready")
    expect(cards.nth(1)).to_contain_text("http://10.0.0.11:28400")
    expect(page.locator('#timeline li[data-kind="host_lost"]')).to_contain_text(
        "Host h0 lost with replica 0; the others serve on"
    )
    expect(page.get_by_role("button", name="Send")).to_be_enabled()  # a degraded deployment serves
    screenshot(page, "deployment-page-after-host-loss.png")
    page.reload()
    expect(cards.nth(0)).to_contain_text("lost with host h0")

    # h0 is back: replica 0 is placed there again and comes up; the card follows.
    def place_again() -> None:
        current = Deployment.objects.get(pk=deployment.pk)
        deployment_services.do_record(current, "placed", {"hosts": [{"host": "h0", "replicas": [0]}], "again": [0]})
        Replica.objects.filter(deployment=current, index=0).update(
            status=Replica.Status.READY, url="http://10.0.0.10:28401", updated_at=timezone.now()
        )
        deployment_services.do_record(current, "replica_ready", {"replica": 0, "url": "http://10.0.0.10:28401"})

    off_loop(place_again)
    expect(cards.nth(0)).to_have_attribute("data-state", "ready")
    expect(cards.nth(0)).not_to_contain_text("lost with host")
    expect(page.locator('#timeline li[data-kind="placed"]')).to_contain_text("Replica placed again: replica 0 on h0")
    console.assert_clean()
