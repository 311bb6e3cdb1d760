"""Runs side by side (`GET /api/runs/compare/`), tags and notes (`PATCH /api/runs/<id>/`), and the
runs list's filters. Runs are rows made through the ORM with events recorded as the control plane
records them; nothing trains."""

from __future__ import annotations

from typing import Any

import pytest
from channels.db import database_sync_to_async

from runs import services, specs
from runs.models import Project, ProjectMember, Run
from tests.platform.conftest import client_for
from tests.platform.test_live_events import _connect as connect_socket

pytestmark = pytest.mark.django_db


def make_run(owner, name: str, spec: dict[str, Any] | None = None, recipe: str = "tiny", **fields: Any) -> Run:
    resolved = specs.resolve_spec(spec or {}, recipe).to_dict()
    return Run.objects.create(owner=owner, name=name, spec=resolved, recipe=recipe, **fields)


def metrics(run: Run, step: int, loss: float, tokens_per_s: float = 1000.0, mfu: float = 0.1) -> None:
    services.do_record_event(run, "metrics", {"step": step, "loss": loss, "lr": 1e-3, "tokens_per_s": tokens_per_s, "mfu": mfu})


# --- Compare -------------------------------------------------------------------------------------


@pytest.fixture
def three_runs(alice):
    base = make_run(alice, "base")
    lower_lr = make_run(alice, "lower lr", {"train": {"lr": 1e-3}})
    wider = make_run(alice, "wider", {"train": {"lr": 1e-3, "global_batch": 16}, "model": {"dim": 256}})
    return base, lower_lr, wider


def test_compare_diff_holds_exactly_the_fields_that_differ(alice_api, three_runs):
    base, lower_lr, wider = three_runs
    response = alice_api.get(f"/api/runs/compare/?ids={base.pk},{lower_lr.pk},{wider.pk}")
    assert response.status_code == 200, response.content
    body = response.json()
    assert [r["id"] for r in body["runs"]] == [base.pk, lower_lr.pk, wider.pk]
    rows = {row["field"]: row["values"] for row in body["spec"]}
    # A wider model has wider heads and MLP too: derived from its dim, they differ with it.
    assert set(rows) == {"train.lr", "train.global_batch", "model.dim", "model.head_dim", "model.ffn_dim"}
    assert rows["train.lr"] == [base.spec["train"]["lr"], 1e-3, 1e-3]
    assert rows["model.dim"] == [128, 128, 256]
    assert rows["model.head_dim"] == [32, 32, 64]
    assert rows["model.ffn_dim"] == [384, 384, 704]
    assert all(row["differs"] for row in body["spec"])

    everything = alice_api.get(f"/api/runs/compare/?ids={base.pk},{lower_lr.pk}&all=1").json()
    fields = {row["field"]: row for row in everything["spec"]}
    assert everything["all_fields"] is True
    assert "layout.dp" in fields and fields["layout.dp"]["differs"] is False
    assert [f for f, row in fields.items() if row["differs"]] == ["train.lr"]


def test_compare_gives_each_runs_series_and_its_final_and_best_figures(alice_api, three_runs):
    base, lower_lr, _ = three_runs
    for step, loss in [(1, 5.0), (2, 4.0), (3, 4.5)]:
        metrics(base, step, loss, tokens_per_s=900.0 + step, mfu=0.05 * step)
    services.do_record_event(base, "eval", {"step": 2, "eval_loss": 4.2})
    metrics(base, 3, 3.5, tokens_per_s=850.0)  # step 3 again after a restart: the later value counts
    metrics(lower_lr, 1, 6.0)

    body = alice_api.get(f"/api/runs/compare/?ids={base.pk},{lower_lr.pk}").json()
    first, second = body["runs"]
    assert first["series"]["loss"] == [[1, 5.0], [2, 4.0], [3, 3.5]]
    assert first["series"]["eval_loss"] == [[2, 4.2]]
    assert first["final"]["loss"] == {"step": 3, "value": 3.5}
    assert first["best"]["loss"] == {"step": 3, "value": 3.5}
    assert first["best"]["tokens_per_s"] == {"step": 2, "value": 902.0}
    assert first["final"]["eval_loss"] == {"step": 2, "value": 4.2}
    assert first["last_seq"] == Run.objects.get(pk=base.pk).last_seq
    assert second["series"]["loss"] == [[1, 6.0]]
    assert second["final"]["eval_loss"] is None and second["best"]["eval_loss"] is None
    # Each run's goodput ledger beside its figures (runs/goodput.py): the base run's three steps
    # after the first are all it did, a run of one step has none.
    assert set(first["goodput"]) == {"wall_s", "goodput", "seconds"}
    assert first["goodput"]["seconds"]["productive"] + first["goodput"]["seconds"]["replayed"] > 0
    assert second["goodput"]["seconds"]["productive"] == 0


@pytest.mark.parametrize(
    ("query", "why"),
    [
        ("", "got 0"),
        ("?ids=", "got 0"),
        ("?ids=7", "got 1"),
        ("?ids=7,7", "got 1"),
        ("?ids=1,2,3,4,5,6,7,8,9", "got 9"),
        ("?ids=1,two", "got '1,two'"),
        ("?ids=1,-2", "got '1,-2'"),
    ],
)
def test_compare_refuses_anything_but_two_to_eight_run_ids_naming_ids(alice_api, query, why):
    response = alice_api.get(f"/api/runs/compare/{query}")
    assert response.status_code == 400, response.content
    message = response.json()["ids"][0]
    assert "2 to 8 different run ids" in message and why in message


def test_compare_refuses_an_all_that_is_not_a_boolean(alice_api, three_runs):
    base, lower_lr, _ = three_runs
    response = alice_api.get(f"/api/runs/compare/?ids={base.pk},{lower_lr.pk}&all=maybe")
    assert response.status_code == 400
    assert "all" in response.json()


def test_compare_answers_404_when_any_run_is_another_users(alice_api, bob, three_runs):
    base, _, _ = three_runs
    bobs = make_run(bob, "bob's")
    response = alice_api.get(f"/api/runs/compare/?ids={base.pk},{bobs.pk}")
    assert response.status_code == 404
    assert str(bobs.pk) in response.json()["detail"]
    assert alice_api.get(f"/api/runs/compare/?ids={base.pk},999999").status_code == 404


# --- Tags and notes ------------------------------------------------------------------------------


def test_the_owner_sets_tags_and_a_note_and_reads_them_back(alice_api, three_runs):
    base = three_runs[0]
    response = alice_api.patch(
        f"/api/runs/{base.pk}/", {"tags": ["baseline", "lr-sweep", "baseline"], "note": "First try."}, format="json"
    )
    assert response.status_code == 200, response.content
    assert response.json()["tags"] == ["baseline", "lr-sweep"]
    assert response.json()["note"] == "First try."
    # Only what is sent changes.
    alice_api.patch(f"/api/runs/{base.pk}/", {"tags": ["lr-sweep", "v2"]}, format="json")
    row = alice_api.get(f"/api/runs/{base.pk}/").json()
    assert row["tags"] == ["lr-sweep", "v2"] and row["note"] == "First try."
    assert row["recipe"] == "tiny"


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({"tags": ["Has Space"]}, "tags", "lower-case letters, digits"),
        ({"tags": ["UPPER"]}, "tags", "lower-case letters, digits"),
        ({"tags": [""]}, "tags", ""),
        ({"tags": ["x" * 33]}, "tags", "1 to 32 characters"),
        ({"tags": [f"t{i}" for i in range(17)]}, "tags", "16"),
        ({"tags": "baseline"}, "tags", ""),
        ({"tags": [3]}, "tags", ""),
        ({"note": "x" * 10_001}, "note", "10000"),
        ({"note": 5}, "note", ""),
    ],
)
def test_bad_tags_or_notes_are_400s_naming_the_field(alice_api, three_runs, body, field, says):
    base = three_runs[0]
    response = alice_api.patch(f"/api/runs/{base.pk}/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert says in str(response.json()[field])
    assert list(Run.objects.get(pk=base.pk).tags.all()) == []


def test_bob_cannot_tag_alices_run(bob_api, three_runs):
    base = three_runs[0]
    assert bob_api.patch(f"/api/runs/{base.pk}/", {"tags": ["mine"]}, format="json").status_code == 404
    assert bob_api.get("/api/runs/?tag=mine").json()["count"] == 0


# --- Search and filters --------------------------------------------------------------------------


def names(api, query: str) -> list[str]:
    response = api.get(f"/api/runs/{query}")
    assert response.status_code == 200, response.content
    return sorted(r["name"] for r in response.json()["results"])


def test_the_runs_list_filters_by_search_tag_status_recipe_and_layout(alice_api, alice, bob):
    sweep = make_run(alice, "LR sweep a", status="succeeded")
    sweep_b = make_run(alice, "lr sweep b", {"layout": {"dp": 2}, "nodes": {"nproc_per_node": 2}}, status="running")
    small = make_run(alice, "small one", recipe="small", status="failed")
    make_run(bob, "lr sweep of bob's")
    alice_api.patch(f"/api/runs/{sweep.pk}/", {"tags": ["sweep", "baseline"]}, format="json")
    alice_api.patch(f"/api/runs/{sweep_b.pk}/", {"tags": ["sweep"]}, format="json")
    alice_api.patch(f"/api/runs/{small.pk}/", {"note": "Tried the LR sweep's best value."}, format="json")

    assert names(alice_api, "?search=lr sweep") == ["LR sweep a", "lr sweep b", "small one"]
    assert names(alice_api, "?tag=sweep") == ["LR sweep a", "lr sweep b"]
    assert names(alice_api, "?tag=sweep,baseline") == ["LR sweep a"]
    assert names(alice_api, "?tag=sweep&tag=baseline") == ["LR sweep a"]
    assert names(alice_api, "?status=running,failed") == ["lr sweep b", "small one"]
    assert names(alice_api, "?recipe=small") == ["small one"]
    assert names(alice_api, "?layout=dp2-tp1-pp1") == ["lr sweep b"]
    assert names(alice_api, "?layout=dp2") == ["lr sweep b"]
    assert names(alice_api, "?layout=2x1x1") == ["lr sweep b"]
    assert names(alice_api, "?layout=tp1") == ["LR sweep a", "lr sweep b", "small one"]
    assert names(alice_api, "?search=sweep&tag=sweep&status=succeeded&layout=dp1") == ["LR sweep a"]


@pytest.mark.parametrize(
    ("query", "field", "says"),
    [
        ("?layout=dp2tp2", "layout", "dp2-tp2-pp1"),
        ("?layout=dp2-dp4", "layout", "dp2-tp2-pp1"),
        ("?layout=dp0", "layout", "dp2-tp2-pp1"),
        ("?layout=dp100000", "layout", "at most 65536"),
        ("?recipe=giant", "recipe", "tiny, small"),
        ("?status=done", "status", "succeeded"),
        ("?tag=Not%20A%20Tag", "tag", "lower-case letters"),
        (f"?search={'x' * 201}", "search", "at most 200"),
        # (The schema fuzz sent 70: each is a join, and SQLite allows 64 tables in one.)
        ("?tag=" + ",".join(f"t{i}" for i in range(17)), "tag", "a run has at most 16 tags, so at most 16 filter runs; got 17"),
    ],
)
def test_bad_filters_are_400s_naming_the_parameter(alice_api, query, field, says):
    response = alice_api.get(f"/api/runs/{query}")
    assert response.status_code == 400, response.content
    assert says in response.json()[field][0]


# --- Projects --------------------------------------------------------------------------------------


@pytest.fixture
def shared(alice_api, alice, bob, charlie):
    """Alice's project with bob a read-only member and charlie a writer, and one of her runs in it."""
    project = alice_api.post("/api/projects/", {"name": "scaling"}, format="json").json()
    assert alice_api.post(f"/api/projects/{project['id']}/members/", {"username": "bob"}, format="json").status_code == 200
    alice_api.post(f"/api/projects/{project['id']}/members/", {"username": "charlie", "role": "write"}, format="json")
    in_project = make_run(alice, "in the project")
    private = make_run(alice, "alice's alone")
    response = alice_api.patch(f"/api/runs/{in_project.pk}/", {"project": project["id"]}, format="json")
    assert response.status_code == 200 and response.json()["project"] == project["id"], response.content
    return project, in_project, private


def test_a_project_member_sees_its_runs_and_a_non_member_gets_404(bob_api, django_user_model, shared):
    project, in_project, private = shared
    assert bob_api.get(f"/api/runs/{in_project.pk}/").status_code == 200
    assert bob_api.get(f"/api/runs/{in_project.pk}/events/").status_code == 200
    assert bob_api.get(f"/api/runs/{in_project.pk}/checkpoints/").status_code == 200
    assert [r["name"] for r in bob_api.get("/api/runs/").json()["results"]] == ["in the project"]
    assert [r["name"] for r in bob_api.get(f"/api/runs/?project={project['id']}").json()["results"]] == ["in the project"]
    assert bob_api.get(f"/api/runs/{private.pk}/").status_code == 404
    assert bob_api.get(f"/api/runs/compare/?ids={in_project.pk},{private.pk}").status_code == 404
    assert bob_api.get(f"/api/projects/{project['id']}/").json()["role"] == "read"

    outsider = client_for(django_user_model.objects.create_user("dave", password="dave-password-1"))
    for path in (f"/api/runs/{in_project.pk}/", f"/api/runs/{in_project.pk}/events/", f"/api/projects/{project['id']}/"):
        assert outsider.get(path).status_code == 404, path
    assert outsider.get("/api/runs/").json()["count"] == 0
    assert outsider.patch(f"/api/runs/{in_project.pk}/", {"note": "x"}, format="json").status_code == 404


def test_a_read_member_may_not_change_a_run_and_a_write_member_may(bob_api, charlie_api, shared):
    project, in_project, _ = shared
    refused = bob_api.patch(f"/api/runs/{in_project.pk}/", {"tags": ["bobs"]}, format="json")
    assert refused.status_code == 403 and "role in its project is read" in refused.json()["detail"]
    assert bob_api.post(f"/api/runs/{in_project.pk}/cancel/").status_code == 403
    assert Run.objects.get(pk=in_project.pk).status == "queued"
    assert charlie_api.patch(f"/api/runs/{in_project.pk}/", {"tags": ["checked"]}, format="json").json()["tags"] == ["checked"]
    # Only the run's owner moves it out of the project; members cannot change the project either.
    assert charlie_api.patch(f"/api/runs/{in_project.pk}/", {"project": None}, format="json").status_code == 403
    assert charlie_api.post(f"/api/projects/{project['id']}/members/", {"username": "bob", "role": "write"}, format="json").status_code == 403
    assert bob_api.delete(f"/api/projects/{project['id']}/").status_code == 403


def test_a_removed_member_no_longer_sees_the_projects_runs(alice_api, bob_api, shared):
    project, in_project, _ = shared
    assert alice_api.delete(f"/api/projects/{project['id']}/members/bob/").status_code == 200
    assert bob_api.get(f"/api/runs/{in_project.pk}/").status_code == 404
    assert alice_api.delete(f"/api/projects/{project['id']}/members/bob/").status_code == 404


def test_runs_go_only_into_projects_one_may_write_to(bob_api, bob, charlie_api, shared):
    project, _, _ = shared
    bobs = make_run(bob, "bob's own")
    response = bob_api.patch(f"/api/runs/{bobs.pk}/", {"project": project["id"]}, format="json")
    assert response.status_code == 400 and "not one you may add runs to" in response.json()["project"][0]
    assert bob_api.patch(f"/api/runs/{bobs.pk}/", {"project": 999999}, format="json").status_code == 400
    launched = charlie_api.post("/api/runs/", {"name": "charlie's", "project": project["id"]}, format="json")
    assert launched.status_code == 201, launched.content
    assert launched.json()["owner"] == "charlie" and launched.json()["project"] == project["id"]
    assert bob_api.post("/api/runs/", {"project": project["id"]}, format="json").status_code == 400


@pytest.mark.parametrize(
    ("body", "field"),
    [({"username": "nobody"}, "username"), ({"username": "alice"}, "username"), ({"username": "bob", "role": "admin"}, "role")],
)
def test_bad_members_are_400s_naming_the_field(alice_api, bob, shared, body, field):
    project, _, _ = shared
    response = alice_api.post(f"/api/projects/{project['id']}/members/", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.content


@pytest.mark.django_db(transaction=True)
async def test_a_members_websocket_streams_the_projects_run_and_a_non_members_is_refused(alice, bob, charlie):
    def setup() -> Run:
        project = Project.objects.create(owner=alice, name="p")
        ProjectMember.objects.create(project=project, user=bob, role="read")
        run = make_run(alice, "shared", project=project)
        metrics(run, 1, 4.2)
        return run

    run = await database_sync_to_async(setup)()
    member = await database_sync_to_async(connect_socket)(bob, run.pk, "?after=0")
    assert (await member.connect())[0]
    message = await member.receive_json_from(timeout=5)
    assert message["events"][0]["loss"] == 4.2
    await member.disconnect()
    outsider = await database_sync_to_async(connect_socket)(charlie, run.pk)
    assert await outsider.connect() == (False, 4404)
