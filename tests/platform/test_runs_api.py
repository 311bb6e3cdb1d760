"""Runs and datasets through the REST API: validation, ownership, state changes, ingest."""

from __future__ import annotations

import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from launch import run_agents
from runs.models import Checkpoint, Run

pytestmark = pytest.mark.django_db


def create_run(api, **body):
    return api.post("/api/runs/", {"name": "r", **body}, format="json")


BAD_SPECS = [
    ({"layout": {"tp": 3}}, ["spec", "layout", "tp"], "must divide model.n_heads"),
    ({"model": {"n_heads": 4, "n_kv_heads": 4}, "layout": {"tp": 8}}, ["spec", "layout", "tp"], "must divide"),
    ({"layout": {"dp": 2}, "nodes": {"max": 1, "nproc_per_node": 1}}, ["spec", "layout", "dp"], "must equal the world size"),
    ({"layout": {"zero": 4}}, ["spec", "layout", "zero"], "must be one of 0, 1, 2, 3"),
    ({"layout": {"schedule": "zigzag"}}, ["spec", "layout", "schedule"], "gpipe, 1f1b, interleaved_1f1b"),
    ({"layout": {"recompute": "some"}}, ["spec", "layout", "recompute"], "none, selective, full"),
    ({"layout": {"pp": 2, "microbatches": 1}}, ["spec", "layout", "microbatches"], "at least one micro-batch per stage"),
    ({"layout": {"dp": 2}, "train": {"global_batch": 3}}, ["spec", "train", "global_batch"], "divisible by layout.dp"),
    ({"train": {"steps": 0}}, ["spec", "train", "steps"], "positive integer"),
    ({"train": {"lr": -1}}, ["spec", "train", "lr"], "must be > 0"),
    ({"model": {"n_heads": "four"}}, ["spec", "model", "n_heads"], "must be an integer"),
    ({"model": {"dim": 100, "n_heads": 3}}, ["spec", "model", "dim"], "divisible by model.n_heads"),
    ({"layout": {"warp": 9}}, ["spec", "layout", "warp"], "not a known field"),
    ({"layout": {"pp": 8, "schedule": "gpipe"}, "model": {"n_layers": 4}}, ["spec", "layout", "pp"], "need at least that many layers"),
    ({"layout": {"zero": 3}}, ["spec", "layout", "zero"], "shards over dp, which is 1"),
    ({"faults": [{"kind": "meteor"}]}, ["spec", "faults", "0", "kind"], "kill_rank"),
    ({"guard": {"nonfinite": "sometimes"}}, ["spec", "guard", "nonfinite"], "must be one of skip, off; got 'sometimes'"),
    ({"guard": {"max_nonfinite_in_a_row": 0}}, ["spec", "guard", "max_nonfinite_in_a_row"], "positive integer"),
]


def test_a_model_of_another_width_gets_the_head_size_and_mlp_width_of_its_own(alice_api):
    response = create_run(alice_api, spec={"model": {"dim": 256, "n_heads": 4}})
    assert response.status_code == 201, response.content
    model = Run.objects.get().spec["model"]
    assert (model["head_dim"], model["ffn_dim"]) == (64, 704)  # 256 / 4, and 8/3·256 rounded up to 64s


@pytest.mark.parametrize(("spec", "path", "message"), BAD_SPECS)
def test_it_rejects_a_bad_spec_naming_the_field(alice_api, spec, path, message):
    response = create_run(alice_api, spec=spec)
    assert response.status_code == 400, response.content
    error = response.json()
    for key in path:
        error = error[key]
    assert message in error[0]
    assert Run.objects.count() == 0


def test_it_rejects_an_unknown_recipe_listing_the_allowed_ones(alice_api):
    response = create_run(alice_api, recipe="giant")
    assert response.status_code == 400
    assert "tiny" in response.json()["recipe"][0]


def test_a_valid_run_is_queued_with_the_recipe_filled_in(alice_api):
    response = create_run(alice_api, recipe="tiny", spec={"layout": {"dp": 2}, "train": {"steps": 7}})
    assert response.status_code == 201, response.content
    run = response.json()
    assert run["status"] == "queued"
    assert run["layout"] == "2×1×1"
    assert run["total_steps"] == 7
    assert run["spec"]["model"]["dim"] == 128  # from the tiny recipe
    # The default guard is left out of the spec, which reads as it did before the guard existed.
    assert "guard" not in run["spec"]
    assert Run.objects.get(pk=run["id"]).events.get().kind == "queued"


def test_a_dataset_upload_is_checked_line_by_line(alice_api):
    good = SimpleUploadedFile("chat.jsonl", b'{"text": "hello"}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    response = alice_api.post("/api/datasets/", {"file": good}, format="multipart")
    assert response.status_code == 201, response.content
    assert response.json()["records"] == 2
    bad = SimpleUploadedFile("bad.jsonl", b'{"text": "ok"}\n{"txt": 1}\n')
    response = alice_api.post("/api/datasets/", {"file": bad}, format="multipart")
    assert response.status_code == 400
    assert "line 2" in response.json()["file"][0]
    wrong_type = SimpleUploadedFile("model.bin", b"\x00\x01")
    assert "must be a .txt or .jsonl" in alice_api.post("/api/datasets/", {"file": wrong_type}, format="multipart").json()["file"][0]


def test_cancelling_a_queued_run_cancels_it_at_once(alice_api):
    run = create_run(alice_api).json()
    response = alice_api.post(f"/api/runs/{run['id']}/cancel/")
    assert response.json()["status"] == "cancelled"
    again = alice_api.post(f"/api/runs/{run['id']}/cancel/")
    assert again.status_code == 409  # the run's state, not the request, refuses it
    assert "this one is cancelled" in again.json()["status"][0]


def test_a_cancelled_run_can_be_resumed_and_a_queued_one_cannot(alice_api):
    run = create_run(alice_api).json()
    refused = alice_api.post(f"/api/runs/{run['id']}/resume/")
    assert refused.status_code == 409
    assert "only failed or cancelled runs can be resumed; this one is queued" in refused.json()["status"][0]
    alice_api.post(f"/api/runs/{run['id']}/cancel/")
    resumed = alice_api.post(f"/api/runs/{run['id']}/resume/").json()
    assert resumed["status"] == "queued"
    assert Run.objects.get(pk=run["id"]).resume is True


def test_a_page_size_past_the_limit_or_not_a_number_is_refused_naming_the_parameter(alice_api):
    create_run(alice_api)
    assert alice_api.get("/api/runs/?limit=1000").json()["count"] == 1
    for query, message in [
        ("limit=9223372036854775808", "limit: must be an integer from 1 to 1000; got 9223372036854775808"),
        ("limit=0", "limit: must be an integer from 1 to 1000; got 0"),
        ("offset=-1", "offset: must be an integer ≥ 0; got -1"),
        ("offset=null", "offset: must be an integer ≥ 0; got 'null'"),
    ]:
        response = alice_api.get(f"/api/runs/?{query}")
        assert response.status_code == 400, query
        field, _, text = message.partition(": ")
        assert response.json() == {field: [text]}


def test_a_path_that_names_no_route_answers_json_under_the_api(alice_api):
    response = alice_api.get("/api/runs/not-a-number/")
    assert (response.status_code, response.json()) == (404, {"detail": "Not found."})


def test_clone_merges_edits_and_validates_them(alice_api):
    run = create_run(alice_api, spec={"train": {"steps": 9}}).json()
    clone = alice_api.post(f"/api/runs/{run['id']}/clone/", {"spec": {"layout": {"recompute": "full"}}}, format="json")
    assert clone.status_code == 201
    assert clone.json()["spec"]["train"]["steps"] == 9
    assert clone.json()["spec"]["layout"]["recompute"] == "full"
    bad = alice_api.post(f"/api/runs/{run['id']}/clone/", {"spec": {"layout": {"tp": 5}}}, format="json")
    assert bad.status_code == 400
    assert "tp" in bad.json()["spec"]["layout"]


def token_for(run_id: int, node: int = 0) -> str:
    """Node `node`'s token in the run's first launch, as `run_agents.prepare` makes it current
    (for a run the launch claimed: a queued run's agents are not started yet)."""
    Run.objects.filter(pk=run_id).update(token_launch=1)
    Run.objects.filter(pk=run_id, status=Run.Status.QUEUED).update(status=Run.Status.STARTING)
    return run_agents.node_token(run_id, 1, node)


def ingest(client, run_id, token, events, source="node-0"):
    return client.post(
        f"/api/runs/{run_id}/events/",
        data=json.dumps({"source": source, "events": events}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )


def test_ingest_needs_the_token_of_the_node_the_batch_names_in_the_runs_current_launch(client, alice_api):
    first = create_run(alice_api).json()["id"]
    second = create_run(alice_api).json()["id"]
    token = token_for(first)
    token_for(second)
    event = [{"seq": 1, "kind": "metrics", "data": {"step": 1, "loss": 5.0}}]
    assert ingest(client, first, "wrong", event).status_code == 401
    assert ingest(client, second, token, event).status_code == 401
    # Node 0's token speaks for node 0 only: a host holds no token of another host's node.
    refused = ingest(client, first, token, event, source="node-1")
    assert refused.status_code == 401
    assert refused.json()["detail"] == (
        'The bearer token of the node that "source" names, in the run\'s current launch, is required.'
    )
    assert ingest(client, first, token_for(first, node=1), event, source="node-1").status_code == 200
    assert ingest(client, first, token, event).status_code == 200
    # A new launch's tokens lock out the last one's.
    Run.objects.filter(pk=first).update(token_launch=2)
    assert ingest(client, first, token, [{**event[0], "seq": 2}]).status_code == 401


def test_ingest_stores_a_redelivered_batch_once_and_keeps_seq_gapless(client, alice_api):
    run_id = create_run(alice_api).json()["id"]
    token = token_for(run_id)
    batch = [{"seq": i, "kind": "metrics", "time": 1.0 + i, "data": {"step": i, "loss": 5.0 - i / 10}} for i in (1, 2, 3)]
    assert ingest(client, run_id, token, batch).json() == {"last_seq": 3}
    assert ingest(client, run_id, token, batch[1:] + [{"seq": 4, "kind": "metrics", "data": {"step": 4, "loss": 4.5}}]).json() == {"last_seq": 4}
    node1 = token_for(run_id, node=1)
    assert ingest(client, run_id, node1, [{"seq": 1, "kind": "agent_started"}], source="node-1").json() == {"last_seq": 1}
    history = alice_api.get(f"/api/runs/{run_id}/events/").json()
    # queued, 3 metrics, the control plane's "status: running", the 4th metrics, node-1's event
    assert [e["seq"] for e in history] == list(range(1, 8))
    assert [e["kind"] for e in history] == ["queued", "metrics", "metrics", "metrics", "status", "metrics", "agent_started"]
    assert history[4]["data"]["status"] == "running"
    assert [e["data"].get("step") for e in history if e["kind"] == "metrics"] == [1, 2, 3, 4]
    run = alice_api.get(f"/api/runs/{run_id}/").json()
    assert run["status"] == "running"
    assert run["step"] == 4
    assert run["last_loss"] == 4.5
    assert [e["seq"] for e in alice_api.get(f"/api/runs/{run_id}/events/?after=4").json()] == [5, 6, 7]


def test_ingest_moves_status_records_checkpoints_and_never_reopens_a_finished_run(client, alice_api):
    run_id = create_run(alice_api).json()["id"]
    token = token_for(run_id)
    events = [
        {"seq": 1, "kind": "metrics", "data": {"step": 1, "loss": 5.0}},
        {"seq": 2, "kind": "checkpoint", "data": {"step": 10, "path": "/tmp/x/step_00000010"}},
        {"seq": 3, "kind": "restarting", "data": {"attempt": 1}},
    ]
    ingest(client, run_id, token, events)
    run = alice_api.get(f"/api/runs/{run_id}/").json()
    assert (run["status"], run["restarts"]) == ("restarting", 1)
    assert Checkpoint.objects.get(run_id=run_id).step == 10
    assert alice_api.get(f"/api/runs/{run_id}/checkpoints/").json()[0]["step"] == 10
    ingest(client, run_id, token, [{"seq": 4, "kind": "succeeded", "data": {}}])
    ingest(client, run_id, token, [{"seq": 5, "kind": "metrics", "data": {"step": 11, "loss": 1.0}}])
    assert alice_api.get(f"/api/runs/{run_id}/").json()["status"] == "succeeded"


def test_ingest_rejects_a_malformed_batch_naming_the_field(client, alice_api):
    run_id = create_run(alice_api).json()["id"]
    token = token_for(run_id)
    response = ingest(client, run_id, token, [{"seq": 0, "kind": "metrics"}])
    assert response.status_code == 400
    assert "greater than or equal to 1" in response.json()["events"]["0"]["seq"][0]


def test_the_planner_ranks_layouts_for_a_cluster(alice_api):
    response = alice_api.get("/api/plan/?model=8b&nodes=2&gpus_per_node=8&gpu=h100&global_batch=64&top=3")
    assert response.status_code == 200, response.content
    plan = response.json()
    assert len(plan["ranked"]) == 3
    assert plan["explanation"]
    assert plan["cluster"]["world_size"] == 16


def test_the_planner_names_a_bad_query_parameter(alice_api):
    response = alice_api.get("/api/plan/?model=8b&gpu=tpu&global_batch=64")
    assert response.status_code == 400
    assert "h100" in response.json()["gpu"][0]
    assert "required" in alice_api.get("/api/plan/?model=8b").json()["global_batch"][0]


def test_the_agent_reads_the_run_token_it_is_launched_with_even_one_starting_with_a_dash(alice_api):
    """secrets.token_urlsafe starts with "-" once in 64 tokens; argparse must not take it for an option."""
    from launch.run_agents import agent_arguments
    from training.agent.cli import _parse_args

    run = Run.objects.get(pk=alice_api.post("/api/runs/", {"name": "t", "recipe": "tiny"}, format="json").json()["id"])
    for token in ("-dash-first_token", "plain-token"):
        args = _parse_args(agent_arguments(run, run.folder, 0, "127.0.0.1:29400", token))
        assert args.run_token == token


def test_a_number_where_the_schema_says_string_is_refused(alice_api):
    response = create_run(alice_api, name=0)
    assert response.status_code == 400
    assert response.json()["name"] == ["Not a valid string."]
