"""The goodput ledger (runs/goodput.py): each second of a run's events in one bucket, and the
ledger through the API and on the run page."""

from __future__ import annotations

import pytest

from runs import services
from runs.goodput import BUCKETS, ledger
from runs.models import Run


def steps(first: int, last: int, start: float, every: float = 1.0) -> list[tuple[str, float, dict]]:
    return [("metrics", start + (s - first + 1) * every, {"step": s}) for s in range(first, last + 1)]


def test_every_second_of_a_troubled_run_lands_in_one_bucket() -> None:
    events = [
        ("queued", 0.0, {}),
        ("agent_started", 10.0, {}),  # 10 s in the queue
        ("rendezvous", 12.0, {"ranks": [0, 1]}),
        *steps(1, 4, 15.0),  # step 1 ends at 16: 6 s of startup; steps 2-4: 1 s each
        ("checkpoint", 19.5, {"step": 4}),
        *steps(5, 6, 21.0),  # step 5's gap is 3 s (19 → 22) with the save: 2 s of it the save
        ("rank_failed", 23.5, {"rank": 1}),  # 0.5 s into step 7: lost
        ("restarting", 24.0, {"from_step": 4}),
        ("resumed", 27.0, {"step": 4}),
        *steps(5, 8, 28.0),  # step 5 again ends at 29 (down since the failure: 6 s), 6 again, 7 and 8
        ("rolled_back", 33.0, {"step": 9, "to_step": 6, "reason": "loss spike"}),  # 1 s of step 9; 7, 8 abandoned
        *steps(7, 8, 34.0),  # step 7 ends at 35 (2 s of rollback), step 8 at 36
        ("eval", 36.5, {"step": 8}),
        *steps(9, 9, 37.5),  # ends at 38.5: 2.5 s gap, 1.5 s of it the evaluation
        ("checkpoint", 39.0, {"step": 9}),
        ("succeeded", 40.0, {}),
    ]
    result = ledger(events)
    seconds = result.seconds
    assert set(seconds) == set(BUCKETS)
    assert result.wall_s == pytest.approx(40.0)  # nothing lost, nothing counted twice
    assert seconds["queued"] == pytest.approx(10.0)
    assert seconds["startup"] == pytest.approx(6.0)
    assert seconds["checkpoint"] == pytest.approx(2.0 + 1.5)  # step 5's stall and the final save
    assert seconds["evaluation"] == pytest.approx(1.5)
    assert seconds["down"] == pytest.approx(0.5 + 0.5 + 5.0)  # the lost part of 7, to the restart, to a step
    assert seconds["replayed"] == pytest.approx(1.0)  # step 6 again (5's replay ended the down time)
    # The spiking step 9, steps 7 and 8 abandoned, the rollback's 2 s to step 7's end again.
    assert seconds["rolled_back"] == pytest.approx(1.0 + 2.0 + 2.0)
    assert seconds["productive"] == pytest.approx(3 + 1 + 1 + 1 + 1)  # 2-4; 5 but its save; 6; 8 again; 9 but its eval
    assert result.goodput == pytest.approx(7 / 40)
    assert result.as_dict()["seconds"]["queued"] == 10.0


def test_a_run_without_events_has_no_goodput() -> None:
    assert ledger([]).goodput is None and ledger([]).wall_s == 0


@pytest.mark.django_db
def test_the_api_returns_the_ledger_of_the_runs_events(alice, alice_api) -> None:
    run = Run.objects.create(owner=alice, name="measured", spec={}, status=Run.Status.RUNNING)
    reported = [
        {"seq": 1, "kind": "agent_started", "time": 100.0, "data": {}},
        *({"seq": s + 1, "kind": "metrics", "time": 102.0 + s, "data": {"step": s, "loss": 5.0}} for s in range(1, 5)),
    ]
    services.do_ingest_events(run, "node-0", reported)
    answer = alice_api.get(f"/api/runs/{run.pk}/goodput/")
    assert answer.status_code == 200, answer.content
    body = answer.json()
    # The control plane's own `queued`-less history starts at the agent: 3 s to the first step, then 3 steps.
    assert body["seconds"]["startup"] == 3.0 and body["seconds"]["productive"] == 3.0
    assert body["wall_s"] == 6.0 and body["goodput"] == 0.5
