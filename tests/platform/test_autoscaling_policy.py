"""The autoscaler's decisions from the replicas' figures, scrape after scrape (deployments.autoscaling),
and the API's `autoscaling`: a wrong policy is a 400 naming its field and stores nothing.
(Real replicas added, drained and put to sleep: tests/serving/test_deployment.py and
tests/platform/test_v1_served.py.)"""

from __future__ import annotations

import subprocess

import pytest
from django.test import Client

from controlplane.exceptions import InvalidInput
from deployments import scaling, services
from deployments.autoscaling import Autoscaling, Decision, Load, ScalerState, decide
from deployments.models import Deployment
from deployments.tasks import reconcile_deployments
from tests.platform.test_deployment_status import make_deployment

POLICY = Autoscaling(min_replicas=1, max_replicas=3, target_waiting=2, window_s=10, cooldown_s=60, idle_s=120)


def run_scrapes(policy: Autoscaling, replicas: int, loads: list[tuple[float, Load]]) -> list[tuple[float, Decision]]:
    """Feeds (time, load) scrapes as the sync does, applying each decision; returns them."""
    state, decided = ScalerState(), []
    for now, load in loads:
        state, decision = decide(policy, replicas, 64, load, state, now)
        if decision is not None:
            decided.append((now, decision))
            replicas = decision.replicas
    return decided


def busy(waiting: float, ready: int = 1, running: float = 64) -> Load:
    return Load(ready=ready, running=running, waiting=waiting)


QUIET = Load(ready=1, running=0, waiting=0)


def test_a_replica_is_added_once_the_waiting_requests_stay_over_the_target_for_the_window():
    # 5 waiting on one replica from t=0, scraped every 2 s: over 2 a replica for 10 s at t=10.
    decided = run_scrapes(POLICY, 1, [(t, busy(5)) for t in range(0, 14, 2)])
    assert [(t, d.replicas) for t, d in decided] == [(10, 2)]
    assert decided[0][1].reason == "5 requests waiting per replica, over the target of 2, for 10 s"


def test_a_dip_under_the_target_starts_the_window_again():
    loads = [(0, busy(5)), (2, busy(5)), (4, busy(1)), *((t, busy(5)) for t in range(6, 20, 2))]
    assert [(t, d.replicas) for t, d in run_scrapes(POLICY, 1, loads)] == [(16, 2)]


def test_no_replica_is_added_while_the_last_one_added_is_still_starting_nor_past_max_replicas():
    # Two running, one ready: the new one is not ready yet, so however long the load lasts nothing more is added.
    state, decision = decide(POLICY, 2, 64, busy(9, ready=1), ScalerState(over_since=0.0), 100.0)
    assert decision is None and state.over_since == 0.0
    _, decision = decide(POLICY, 3, 64, busy(9, ready=3), ScalerState(over_since=0.0), 100.0)
    assert decision is None


def test_a_replica_is_removed_after_the_cooldown_once_the_load_fits_on_fewer_and_never_below_min_replicas():
    light = Load(ready=3, running=10, waiting=0)  # fits on 2 replicas of 64
    decided = run_scrapes(POLICY, 3, [(t, light) for t in range(0, 200, 5)])
    # Each change starts the conditions over: the second cooldown counts from the scrape after it.
    assert [(t, d.replicas) for t, d in decided] == [(60, 2), (125, 1)]
    assert decided[0][1].reason == "no request waiting and 10 running (room for 64 a replica) for 60 s"


def test_running_requests_that_need_every_replica_keep_them():
    full = Load(ready=2, running=100, waiting=0)  # 100 > 64 on one replica
    assert run_scrapes(POLICY, 2, [(t, full) for t in range(0, 400, 5)]) == []


def test_a_deployment_that_may_sleep_sleeps_after_idle_s_without_a_request_and_a_keys_request_resets_it():
    may_sleep = Autoscaling(min_replicas=0, max_replicas=2, idle_s=30, cooldown_s=10)
    # A request between two scrapes: none saw it run, its key's last use says it came at t=21.
    after_one = Load(ready=1, running=0, waiting=0, last_request_at=21.0)
    running_one = Load(ready=1, running=1, waiting=0)
    loads = [*((t, QUIET) for t in range(0, 20, 2)), *((t, after_one) for t in range(22, 60, 2))]
    decided = run_scrapes(may_sleep, 1, loads)
    assert [(t, d.replicas) for t, d in decided] == [(52, 0)]
    assert decided[0][1].reason == "no request for 31 s"
    loads = [*((t, QUIET) for t in range(0, 20, 2)), (20, running_one), *((t, QUIET) for t in range(22, 60, 2))]
    assert [(t, d.replicas) for t, d in run_scrapes(may_sleep, 1, loads)] == [(52, 0)]
    assert run_scrapes(POLICY, 1, [(t, QUIET) for t in range(0, 1000, 10)]) == []  # min_replicas 1 never sleeps


def test_a_count_outside_a_changed_policys_bounds_moves_to_the_nearest_bound_at_once():
    _, decision = decide(POLICY, 5, 64, busy(0, ready=5, running=0), ScalerState(), 0.0)
    assert decision == Decision(3, "5 replicas lie outside autoscaling's 1 to 3")


@pytest.mark.parametrize(
    ("policy", "field", "message"),
    [
        ({"max_replicas": 0}, "autoscaling.max_replicas", "must be at least 1 and at least min_replicas (1); got 0"),
        ({"min_replicas": 3, "max_replicas": 2}, "autoscaling.max_replicas", "must be at least 1 and at least min_replicas (3); got 2"),
        ({"min_replicas": -1}, "autoscaling.min_replicas", "must be an integer from 0 to 16; got -1"),
        ({"target_waiting": 0}, "autoscaling.target_waiting", "must be a positive number; got 0"),
        ({"idle_s": "soon"}, "autoscaling.idle_s", "must be a positive number; got 'soon'"),
        ({"max_replica": 2}, "autoscaling.max_replica", "is not an autoscaling field; fields are min_replicas, "
         "max_replicas, target_waiting, window_s, cooldown_s, idle_s, wake_timeout_s"),
    ],
)
def test_a_wrong_policy_names_its_field(policy, field, message):
    with pytest.raises(InvalidInput) as raised:
        Autoscaling.from_dict(policy)
    assert (raised.value.field, raised.value.message) == (field, message)


@pytest.mark.django_db
def test_the_api_takes_a_policy_at_create_and_later_and_refuses_a_wrong_one_storing_nothing(alice, alice_api):
    deployment = make_deployment(alice, Deployment.Status.READY, replicas=2)
    refused = alice_api.post(
        "/api/deployments/",
        {"checkpoint": deployment.checkpoint_id, "replicas": 3, "autoscaling": {"max_replicas": 2}},
        content_type="application/json",
    )
    assert refused.status_code == 400
    assert refused.json() == {"replicas": ["must lie within autoscaling's min_replicas and max_replicas (1 to 2); got 3"]}
    assert Deployment.objects.count() == 1
    url = f"/api/deployments/{deployment.pk}/autoscaling/"
    wrong = alice_api.put(url, {"autoscaling": {"min_replicas": 0, "max_replicas": 2, "window_s": -1}}, content_type="application/json")
    assert wrong.status_code == 400
    assert wrong.json() == {"autoscaling": {"window_s": ["must be a positive number; got -1"]}}
    assert Deployment.objects.get(pk=deployment.pk).autoscaling is None and not deployment.events.exists()

    answer = alice_api.put(url, {"autoscaling": {"min_replicas": 0, "max_replicas": 4}}, content_type="application/json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["autoscaling"] == {
        "min_replicas": 0, "max_replicas": 4, "target_waiting": 1.0, "window_s": 30.0, "cooldown_s": 300.0,
        "idle_s": 600.0, "wake_timeout_s": 300.0,
    }  # fmt: skip
    assert answer.json()["replicas"] == 2
    assert list(deployment.events.values_list("kind", flat=True)) == ["autoscaling"]
    assert alice_api.put(url, {"autoscaling": None}, content_type="application/json").json()["autoscaling"] is None

    deployment.status = Deployment.Status.STOPPED
    deployment.save()
    stopped = alice_api.put(url, {"autoscaling": {"max_replicas": 2}}, content_type="application/json")
    assert stopped.status_code == 409


@pytest.mark.django_db
def test_the_deployment_page_shows_the_policy_the_count_and_the_decisions_with_their_reasons(alice):
    deployment = make_deployment(
        alice, Deployment.Status.ASLEEP, replicas=0,
        autoscaling=Autoscaling(min_replicas=0, max_replicas=3, target_waiting=1.5).to_dict(),
    )  # fmt: skip
    services.do_record(deployment, "scaled", {"from": 2, "to": 1, "reason": "no request waiting and 3 running"})
    services.do_record(deployment, "scaled", {"from": 1, "to": 0, "reason": "no request for 601 s"})
    services.do_record(deployment, "asleep", {"reason": "scaled to zero: the next request wakes it"})
    browser = Client()
    browser.force_login(alice)
    page = browser.get(f"/deployments/{deployment.pk}").content.decode()
    assert "asleep: no replica runs; the next request wakes it · autoscaled from 0 to 3, target 1.5 waiting a replica" in page
    decisions = page.split('id="scaling-decisions"')[1].split("</ul>")[0]
    assert decisions.index("asleep: scaled to zero") < decisions.index("1 → 0 replicas: no request for 601 s")
    assert decisions.index("1 → 0 replicas") < decisions.index("2 → 1 replicas: no request waiting and 3 running")


@pytest.mark.django_db
def test_a_deployment_going_to_sleep_is_not_failed_for_its_supervisors_exit(alice):
    gone = subprocess.Popen(["true"])
    gone.wait()
    # Scaled to zero: the sleep task stopped its supervisor and has yet to mark it asleep.
    going = make_deployment(alice, Deployment.Status.READY, replicas=0, supervisor_pid=gone.pid)
    assert reconcile_deployments() == 0
    assert Deployment.objects.get(pk=going.pk).status == "ready"


@pytest.mark.django_db
def test_a_woken_deployment_is_not_failed_for_its_last_supervisors_exit_while_it_starts(alice):
    gone = subprocess.Popen(["true"])
    gone.wait()
    asleep = make_deployment(
        alice, Deployment.Status.ASLEEP, replicas=0, supervisor_pid=gone.pid,
        autoscaling=Autoscaling(min_replicas=0, max_replicas=2).to_dict(),
    )  # fmt: skip
    assert scaling.wake(asleep.pk) and not scaling.wake(asleep.pk)  # many held requests wake it once
    woken = Deployment.objects.get(pk=asleep.pk)
    assert (woken.status, woken.replicas, woken.supervisor_pid) == ("pending", 1, None)
    # The start task has claimed it and not yet named its new supervisor: a reconcile meanwhile.
    services.do_set_status(woken, Deployment.Status.STARTING, only_from=[Deployment.Status.PENDING], event=None)
    assert reconcile_deployments() == 0
    assert list(woken.events.values_list("kind", flat=True)) == ["waking"]
