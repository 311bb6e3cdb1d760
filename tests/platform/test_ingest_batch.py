"""An agent's batch through `POST /api/runs/<id>/events/`: stored whole or not at all, numbered
without gaps, and published to the run's followers as one message."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer

from launch import run_agents
from runs import services
from runs.models import Run, RunEvent

pytestmark = pytest.mark.django_db


@pytest.fixture
def run(alice) -> Run:
    return Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.RUNNING, token_launch=1)


def metrics(seqs) -> list[dict]:
    return [{"seq": s, "kind": "metrics", "time": 1.0e9 + s, "data": {"step": s, "loss": 5.0 - s / 100}} for s in seqs]


def token_of_sender(run: Run, body) -> str:
    """The token of the node the batch names (node 0's where it names none)."""
    source = body.get("source") if isinstance(body, dict) else None
    node = int(source[5:]) if isinstance(source, str) and source[5:].isdigit() else 0
    return run_agents.node_token(run.pk, 1, node)


def ingest(client, run: Run, body) -> object:
    return client.post(
        f"/api/runs/{run.pk}/events/",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token_of_sender(run, body)}",
    )


def follow(run: Run) -> tuple[object, str]:
    """A channel in the run's group, as a websocket consumer joins it."""
    layer = get_channel_layer()
    channel = async_to_sync(layer.new_channel)()
    async_to_sync(layer.group_add)(services.run_group(run.pk), channel)
    return layer, channel


def test_a_batch_is_stored_with_contiguous_seqs_and_reaches_followers_as_one_message(
    client, alice_api, run, django_capture_on_commit_callbacks
):
    layer, channel = follow(run)
    with django_capture_on_commit_callbacks(execute=True):
        first = ingest(client, run, {"source": "node-0", "events": metrics(range(1, 251))})
    assert first.status_code == 200, first.content
    assert first.json() == {"last_seq": 250}
    with django_capture_on_commit_callbacks(execute=True):
        ingest(client, run, {"source": "node-0", "events": metrics(range(251, 261))})

    async def two_messages() -> list[dict]:  # one event loop: channels-redis keeps its reader per loop
        return [await layer.receive(channel), await layer.receive(channel)]

    message, following = async_to_sync(two_messages)()
    assert message["type"] == "stream.events"
    assert [e["seq"] for e in message["events"]] == list(range(1, 251))
    assert message["events"][0] == {
        "seq": 1, "kind": "metrics", "time": 1.0e9 + 1, "source": "node-0", "step": 1, "loss": 4.99,
    }  # fmt: skip
    # Had the first batch been split, the rest of it would come before the second batch.
    assert [e["seq"] for e in following["events"]] == list(range(251, 261))

    history = alice_api.get(f"/api/runs/{run.pk}/events/").json()
    assert [e["seq"] for e in history] == list(range(1, 261))
    assert [e["source_seq"] for e in history] == list(range(1, 261))
    shown = alice_api.get(f"/api/runs/{run.pk}/").json()
    assert (shown["step"], shown["last_loss"]) == (260, 2.4)


def test_a_redelivered_batch_overlapping_the_stored_one_adds_only_what_is_new(client, run):
    assert ingest(client, run, {"source": "node-0", "events": metrics([1, 2, 3])}).json() == {"last_seq": 3}
    again = ingest(client, run, {"source": "node-0", "events": metrics([2, 3, 4, 4, 5])})
    assert again.json() == {"last_seq": 5}
    assert ingest(client, run, {"source": "node-0", "events": metrics([1, 2])}).json() == {"last_seq": 5}
    assert list(run.events.order_by("seq").values_list("seq", "source_seq")) == [(i, i) for i in range(1, 6)]


BAD_EVENTS = [
    ({"seq": 4, "kind": ""}, "kind", "non-empty"),
    ({"seq": 4, "kind": "k" * 33}, "kind", "no more than 32"),
    ({"seq": 4, "kind": 7}, "kind", "string"),
    ({"seq": 4}, "kind", "required"),
    ({"seq": "4", "kind": "metrics"}, "seq", "integer"),
    ({"seq": 0, "kind": "metrics"}, "seq", "greater than or equal to 1"),
    ({"seq": 4, "kind": "metrics", "time": "now"}, "time", "number"),
    ({"seq": 4, "kind": "metrics", "data": [1]}, "data", "object"),
]


@pytest.mark.parametrize(("bad", "field", "message"), BAD_EVENTS)
def test_a_bad_event_in_a_batch_is_named_and_nothing_of_the_batch_is_stored(client, run, bad, field, message):
    events = [*metrics([1, 2, 3]), bad, *metrics([5])]
    response = ingest(client, run, {"source": "node-0", "events": events})
    assert response.status_code == 400, response.content
    assert message in response.json()["events"]["3"][field][0]
    assert not RunEvent.objects.filter(run=run).exists()
    assert Run.objects.get(pk=run.pk).last_seq == 0


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"events": []}, "source"),
        ({"source": "node 0", "events": []}, "source"),
        ({"source": "node-0\n", "events": []}, "source"),
        ({"source": "node-0"}, "events"),
        ({"source": "node-0", "events": {"seq": 1}}, "events"),
        ([], "non_field_errors"),
    ],
)
def test_a_malformed_batch_names_the_field(client, run, body, field):
    response = ingest(client, run, body)
    assert response.status_code == 400, response.content
    assert field in response.json()


def test_an_agent_that_fails_after_its_run_was_asked_to_cancel_ends_the_run_cancelled(client, run):
    # Each host's agent gets its own stop signal: one not yet signalled when another closed the
    # rendezvous reports a failed rendezvous.
    Run.objects.filter(pk=run.pk).update(cancel_requested=True)
    failed = {"seq": 1, "kind": "failed", "time": 1.0e9, "data": {"reason": "rendezvous: RendezvousClosedError"}}
    assert ingest(client, run, {"source": "node-1", "events": [failed]}).status_code == 200
    run.refresh_from_db()
    assert (run.status, run.status_reason) == ("cancelled", "rendezvous: RendezvousClosedError")


def test_an_agent_that_fails_without_a_cancel_fails_the_run(client, run):
    failed = {"seq": 1, "kind": "failed", "time": 1.0e9, "data": {"reason": "rank 0 exited with 1"}}
    ingest(client, run, {"source": "node-0", "events": [failed]})
    assert Run.objects.get(pk=run.pk).status == "failed"


def test_a_run_queued_again_is_not_ended_by_what_its_stopped_agents_still_report(client, run):
    # A host loss left too few nodes: the run was queued to resume, and the agents left were
    # stopped. Their last words (metrics, `cancelled`) are kept but move nothing; the next
    # launch's agent moves the run on.
    Run.objects.filter(pk=run.pk).update(status=Run.Status.QUEUED, status_reason="")
    cancelled = {"seq": 3, "kind": "cancelled", "time": 1.0e9 + 3, "data": {"step": 2}}
    assert ingest(client, run, {"source": "node-0", "events": [*metrics([1, 2]), cancelled]}).status_code == 200
    run.refresh_from_db()
    assert (run.status, run.step) == ("queued", 2)
    assert list(run.events.filter(source="node-0").values_list("kind", flat=True)) == ["metrics", "metrics", "cancelled"]
    started = {"seq": 4, "kind": "agent_started", "time": 1.0e9 + 4, "data": {"node": 0}}
    succeeded = {"seq": 6, "kind": "succeeded", "time": 1.0e9 + 6, "data": {"step": 4}}
    ingest(client, run, {"source": "node-0", "events": [started, *metrics([5]), succeeded]})
    assert Run.objects.get(pk=run.pk).status == "succeeded"  # a job that ran whole before squeue said so


def test_a_rollback_marks_the_abandoned_checkpoints_pruned_and_a_step_saved_again_counts_anew(run, tmp_path):
    folders = {step: tmp_path / f"step_{step:08d}" for step in (4, 8, 12)}
    for folder in folders.values():
        folder.mkdir()

    def report(seq: int, kind: str, **data: object) -> None:
        services.do_ingest_events(run, "node-0", [{"seq": seq, "kind": kind, "time": None, "data": data}])

    for seq, step in enumerate((4, 8, 12), 1):
        report(seq, "checkpoint", step=step, path=str(folders[step]), eval_loss=5.0 - step / 10)
    # The guard rolled back from a spike at step 13 to step 4; the ranks deleted 8 and 12 first.
    folders[8].rmdir()
    folders[12].rmdir()
    report(4, "rolled_back", step=13, to_step=4, source="checkpoint", skipped_batches=9, reason="loss spike", rollbacks=1)
    pruned = {c.step: c.pruned_at is not None for c in run.checkpoints.all()}
    assert pruned == {4: False, 8: True, 12: True}
    assert sorted(e.data["step"] for e in RunEvent.objects.filter(run=run, kind="checkpoint_pruned")) == [8, 12]
    # Step 8 of the run after the rollback: a checkpoint again, with its own evaluation.
    folders[8].mkdir()
    report(5, "checkpoint", step=8, path=str(folders[8]), eval_loss=4.1)
    again = run.checkpoints.get(step=8)
    assert (again.pruned_at, again.eval_loss) == (None, 4.1)


def test_a_straggler_reported_by_rank_0_is_stored_with_the_host_its_rank_runs_on(run):
    def report(seq: int, kind: str, **data: object) -> None:
        services.do_ingest_events(run, "node-0", [{"seq": seq, "kind": kind, "time": None, "data": data}])

    report(1, "rendezvous", attempt=0, host="node-a", ranks=[0, 1], world_size=4)
    report(2, "rendezvous", attempt=0, host="node-b", ranks=[2, 3], world_size=4)
    report(3, "straggler", step=30, rank=3, steps=20, own_s=0.25, others_s=0.05, slower_by=5.0)
    report(4, "rendezvous", attempt=1, host="node-c", ranks=[2, 3], world_size=4)  # placed again elsewhere
    report(5, "straggler_cleared", step=70, rank=3, steps=20, own_s=0.05, others_s=0.05, slower_by=1.0)
    stored = {e.kind: e.data for e in RunEvent.objects.filter(run=run, kind__startswith="straggler")}
    assert stored["straggler"]["host"] == "node-b" and stored["straggler_cleared"]["host"] == "node-c"
