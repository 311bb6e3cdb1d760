"""The dashboard's server side without a browser: pages answer their owner only, and the runs
list's sparklines come thinned from each run's own loss history."""

from __future__ import annotations

import pytest

from dashboard.views import SPARKLINE_POINTS
from deployments.models import Deployment
from runs.models import Checkpoint, Project, ProjectMember, Run, RunEvent

pytestmark = pytest.mark.django_db


def run_with_losses(owner, losses: dict[int, float], name: str = "run") -> Run:
    run = Run.objects.create(owner=owner, name=name, spec={"layout": {"dp": 2}, "train": {"steps": 10}})
    for seq, (step, loss) in enumerate(losses.items(), start=1):
        RunEvent.objects.create(
            run=run,
            seq=seq,
            source="node-0",
            source_seq=seq,
            kind="metrics",
            time="2026-01-01T00:00:00Z",
            data={"step": step, "loss": loss},
        )
    return run


def test_every_page_asks_for_a_login(client, alice):
    run = Run.objects.create(owner=alice, name="mine", spec={})
    for path in ("/", "/runs/new", f"/runs/{run.pk}", f"/runs/compare/?ids={run.pk},1", "/deployments", "/hosts", "/dashboard/sparklines/?runs=1"):
        response = client.get(path)
        assert response.status_code == 302 and response.url.startswith("/login/"), path


def test_another_users_run_and_deployment_pages_answer_404(client, alice, bob):
    run = Run.objects.create(owner=alice, name="mine", spec={})
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d")
    bobs = Run.objects.create(owner=bob, name="bob's", spec={})
    client.force_login(bob)
    for path in (f"/runs/{run.pk}", f"/deployments/{deployment.pk}", f"/runs/compare/?ids={bobs.pk},{run.pk}"):
        page = client.get(path)
        assert page.status_code == 404
        # The dashboard's own page, with the way back, not a bare "Not Found".
        assert b"Your runs" in page.content and b"Log out bob" in page.content
    assert client.get(f"/runs/compare/?ids={bobs.pk}").status_code == 400  # one run is no comparison
    client.force_login(alice)
    assert b"mine" in client.get(f"/runs/{run.pk}").content
    assert client.get(f"/deployments/{deployment.pk}").status_code == 200


def test_the_launch_form_names_each_input_by_its_path_in_the_api_body(client, alice):
    client.force_login(alice)
    page = client.get("/runs/new").content.decode()
    for path in (
        "spec.layout.tp",
        "spec.layout.schedule",
        "spec.train.lr",
        "spec.nodes.max",
        "spec.model.n_heads",
        "spec.faults.0.kind",
    ):
        assert f'name="{path}"' in page and f'data-error-for="{path}"' in page
    assert '"tiny": {"model": {"n_layers": 4' in page  # the recipes, for the placeholders


def test_a_sparkline_keeps_the_latest_loss_of_a_step_run_again_after_a_restart(client, alice):
    run = run_with_losses(alice, {1: 5.0, 2: 4.0})
    RunEvent.objects.create(
        run=run,
        seq=3,
        source="node-0",
        source_seq=3,
        kind="metrics",
        time="2026-01-01T00:00:00Z",
        data={"step": 2, "loss": 3.5},
    )
    client.force_login(alice)
    assert client.get(f"/dashboard/sparklines/?runs={run.pk}").json() == {str(run.pk): [[1, 5.0], [2, 3.5]]}


def test_a_long_run_is_thinned_to_a_sparkline_that_keeps_its_ends(client, alice):
    run = run_with_losses(alice, {step: 10.0 - step / 100 for step in range(1, 1001)})
    client.force_login(alice)
    points = client.get(f"/dashboard/sparklines/?runs={run.pk}").json()[str(run.pk)]
    assert len(points) == SPARKLINE_POINTS
    assert points[0] == [1, 9.99] and points[-1] == [1000, 0.0]
    assert [p[0] for p in points] == sorted(p[0] for p in points)


def test_sparklines_leave_out_other_users_runs_and_reject_a_malformed_list(client, alice, bob):
    mine = run_with_losses(alice, {1: 2.0, 2: 1.0}, "mine")
    theirs = run_with_losses(bob, {1: 2.0, 2: 1.0}, "theirs")
    client.force_login(alice)
    assert set(client.get(f"/dashboard/sparklines/?runs={mine.pk},{theirs.pk}").json()) == {str(mine.pk)}
    assert client.get("/dashboard/sparklines/?runs=1,x").status_code == 400


def test_a_project_members_run_page_shows_the_run_without_changes_for_a_reader(client, alice, bob, django_user_model):
    project = Project.objects.create(owner=alice, name="scaling")
    ProjectMember.objects.create(project=project, user=bob, role="read")
    run = Run.objects.create(owner=alice, name="shared", spec={}, project=project, note="Alice's notes.")
    client.force_login(bob)
    page = client.get(f"/runs/{run.pk}")
    assert page.status_code == 200
    assert "scaling</span> · launched by alice" in page.content.decode()
    assert b"Alice&#x27;s notes." in page.content and b"organise-form" not in page.content
    assert client.get(f"/runs/compare/?ids={run.pk},{run.pk + 1}").status_code == 404
    client.force_login(django_user_model.objects.create_user("dave"))
    assert client.get(f"/runs/{run.pk}").status_code == 404
