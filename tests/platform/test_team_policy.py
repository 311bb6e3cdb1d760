"""A cluster shared by a team (issue 36): quotas and the priority ceiling through the API, fair
share among runs of one priority, backfill that never takes the head of the queue's reservation,
the device kind and host labels a run asks for, and the queue as the API shows it. On the real
database, through the real scheduling pass (start tasks are not sent: `schedule` only claims)."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from hosts.models import DeviceClaim, Host
from hosts.scheduling import schedule
from hosts.tasks import RUNS_SIDE
from runs import services
from runs.models import Project, Run
from tests.platform.conftest import client_for
from tests.platform.test_placement import host_tasks, purge_host_queues

pytestmark = pytest.mark.django_db

ONE = {"train": {"steps": 4, "warmup_steps": 2}}  # one rank: one device
TWO_NODES_OF_TWO = {"layout": {"dp": 4}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 2}, "train": {"steps": 4, "warmup_steps": 2}}


def add_host(name: str, count: int, kind: str = "cpu", **labels: str) -> Host:
    return Host.objects.create(
        name=name, address=f"10.9.1.{Host.objects.count() + 1}", labels=labels,
        devices=[{"index": i, "kind": kind, "memory_mb": 81559 if kind == "gpu" else 0} for i in range(count)],
    )  # fmt: skip


def submit(api, name: str, spec: dict, **extra):
    return api.post("/api/runs/", {"name": name, "spec": spec, **extra}, format="json")


def placed_on(run_id: int) -> list[str]:
    return sorted(f"{c.host.name}:{c.device}" for c in DeviceClaim.objects.filter(run_id=run_id).select_related("host"))


@pytest.fixture
def staff_api(django_user_model):
    return client_for(django_user_model.objects.create_user("root", password="root-password-1", is_staff=True))


def test_priority_is_bounded_by_a_ceiling_staff_set_and_a_queue_cap_refuses_the_next_submit(alice, alice_api, staff_api):
    refused = submit(alice_api, "jumps the queue", ONE, priority=1)
    assert refused.status_code == 400
    assert refused.json() == {"priority": ["must be at most 0, your ceiling (staff set it); got 1"]}
    assert alice_api.get("/api/quota/").json()["priority_ceiling"] == 0
    assert alice_api.post("/api/quotas/", {"user": "alice", "priority_ceiling": 5}, format="json").status_code == 403
    created = staff_api.post("/api/quotas/", {"user": "alice", "priority_ceiling": 3, "queued_runs": 2}, format="json")
    assert created.status_code == 201, created.json()
    assert submit(alice_api, "urgent", ONE, priority=3).status_code == 201
    assert submit(alice_api, "too urgent", ONE, priority=4).json() == {"priority": ["must be at most 3, your ceiling (staff set it); got 4"]}
    assert submit(alice_api, "second", ONE).status_code == 201
    capped = submit(alice_api, "third", ONE)
    assert capped.status_code == 400
    assert capped.json() == {"quota": ["2 of 2 queued runs allowed for your runs already wait; cancel one or wait until one starts"]}
    assert Run.objects.filter(owner=alice).count() == 2  # the refused ones left nothing behind
    assert alice_api.get("/api/quota/").json()["user"]["queued_runs"] == {"limit": 2, "in_use": 2}
    both = staff_api.post("/api/quotas/", {"user": "alice", "project": None, "gpus": 1}, format="json")
    assert both.json() == {"user": ["has a quota already: change that one"]}
    neither = staff_api.post("/api/quotas/", {"gpus": 1}, format="json")
    assert neither.json() == {"user": ["set exactly one of user and project"]}


def test_a_run_over_its_quota_waits_saying_so_and_blocks_nobody(alice, bob, alice_api, bob_api, staff_api):
    add_host("g", 4, "gpu")
    staff_api.post("/api/quotas/", {"user": "alice", "gpus": 2}, format="json")
    mine = [submit(alice_api, f"a{i}", ONE).json()["id"] for i in range(3)]
    theirs = submit(bob_api, "b", ONE).json()["id"]
    assert sorted(schedule(RUNS_SIDE)) == sorted([mine[0], mine[1], theirs])
    waiting = Run.objects.get(pk=mine[2])
    assert waiting.status_reason == "quota: 2 of 2 GPUs in use by your runs; this run needs 1 GPU"
    assert not waiting.events.filter(kind="waiting").exists()  # one UPDATE for a quota's runs, no event each
    assert alice_api.get("/api/quota/").json()["user"]["gpus"] == {"limit": 2, "in_use": 2}
    # One of hers ends: its GPU goes back and her third run takes it.
    services.do_set_status(Run.objects.get(pk=mine[0]), Run.Status.SUCCEEDED)
    assert schedule(RUNS_SIDE) == [mine[2]]


def test_a_projects_quota_counts_every_members_runs_in_it(alice, bob, alice_api, bob_api, staff_api):
    add_host("c", 4)
    project = Project.objects.create(owner=alice, name="lab")
    project.members.create(user=bob, role="write")
    assert staff_api.post("/api/quotas/", {"project": project.pk, "cpu_slots": 2, "preemptible": False}, format="json").status_code == 201
    ids = [submit(api, name, ONE, project=project.pk).json()["id"] for api, name in ((alice_api, "a"), (bob_api, "b"), (bob_api, "c"))]
    own = submit(bob_api, "outside the project", ONE).json()["id"]
    assert sorted(schedule(RUNS_SIDE)) == sorted([ids[0], ids[1], own])
    assert Run.objects.get(pk=ids[2]).status_reason == "quota: 2 of 2 CPU slots in use by the runs of project 'lab'; this run needs 1 CPU slot"
    shown = bob_api.get("/api/quota/").json()["projects"]
    assert shown == [{"id": project.pk, "name": "lab", "preemptible": False, "gpus": {"limit": None, "in_use": 0},
                      "cpu_slots": {"limit": 2, "in_use": 2}, "queued_runs": {"limit": None, "in_use": 1}}]  # fmt: skip


def test_among_runs_of_one_priority_the_share_with_the_least_recent_use_goes_first(alice, bob, charlie, alice_api, bob_api, charlie_api):
    add_host("c", 4)
    # Bob's runs held 4 slots for the last two days (recent use 4 × (1 - 2^-2) = 3 slots); Alice's
    # one slot for an hour a day ago (0.015); Charlie none.
    now = timezone.now()
    for owner, slots, began, ended in ((bob, 4, 48, 0), (alice, 1, 26, 25)):
        Run.objects.create(
            owner=owner, name="earlier", status=Run.Status.SUCCEEDED, spec={"layout": {"dp": slots}},
            started_at=now - timedelta(hours=began), finished_at=now - timedelta(hours=ended),
        )  # fmt: skip
    bobs = [submit(bob_api, f"b{i}", ONE).json()["id"] for i in range(3)]
    alices = [submit(alice_api, f"a{i}", ONE).json()["id"] for i in range(3)]
    charlies = [submit(charlie_api, f"c{i}", ONE).json()["id"] for i in range(2)]
    queue = alice_api.get("/api/queue/").json()
    # Each run offered room adds its slots to its share's score: Charlie and Alice alternate, and
    # Bob, who used most lately, comes last though he submitted first.
    assert [e["id"] for e in queue] == [charlies[0], alices[0], charlies[1], alices[1], alices[2], *bobs]
    assert [e["share"] for e in queue[:2]] == ["user charlie", "user alice"]
    assert abs(queue[-1]["share_recent_slots"] - 3.0) < 0.01
    assert sorted(schedule(RUNS_SIDE)) == sorted([charlies[0], alices[0], charlies[1], alices[1]])


def test_the_head_reserves_and_smaller_runs_backfill_only_around_it(alice, alice_api):
    add_host("a", 2, "gpu")
    add_host("b", 2, "gpu")
    add_host("c", 1, "gpu")
    running = submit(alice_api, "running", {"layout": {"dp": 2}, "train": {"steps": 100, "warmup_steps": 2}}).json()["id"]
    assert schedule(RUNS_SIDE) == [running]
    assert placed_on(running) == ["a:0", "a:1"]
    started = timezone.now() - timedelta(seconds=50)
    Run.objects.filter(pk=running).update(status=Run.Status.RUNNING, started_at=started, step=50)
    head = submit(alice_api, "head", TWO_NODES_OF_TWO).json()["id"]
    small = [submit(alice_api, f"small{i}", ONE).json()["id"] for i in range(3)]
    placed = schedule(RUNS_SIDE)
    reservation = Run.objects.get(pk=head).reservation
    assert reservation["until"] == [running]
    expected = datetime.fromisoformat(reservation["expected_at"])
    assert abs((expected - (timezone.now() + timedelta(seconds=50))).total_seconds()) < 65  # 50 more steps at 1 s each, to the minute
    reserved = set(reservation["devices"])
    assert len(reserved) == 4 and {d.split(":")[0] for d in reserved} == {"a", "b"}
    # The small runs took only what the head does not hold: the free GPU outside its reservation.
    assert placed == [small[0]] and placed_on(small[0]) == ["c:0"]
    shown = alice_api.get(f"/api/runs/{small[-1]}/").json()["status_reason"]
    assert shown.startswith(f"waiting: behind run {head} at the head of the queue")
    assert Run.objects.get(pk=small[-1]).status_reason == ""  # said when read, not stored run by run
    # The long run ends: the head starts at once, on what it held.
    services.do_set_status(Run.objects.get(pk=running), Run.Status.SUCCEEDED)
    assert head in schedule(RUNS_SIDE)
    assert set(placed_on(head)) == reserved
    assert Run.objects.get(pk=head).reservation == {}


def test_a_run_goes_only_to_the_device_kind_and_host_labels_it_asks_for(alice, alice_api):
    add_host("gpu-a", 1, "gpu", zone="a")
    add_host("gpu-b", 1, "gpu", zone="b")
    add_host("cpu", 4, "cpu", zone="a")
    first = submit(alice_api, "default: GPUs where there are some", ONE).json()["id"]
    in_b = submit(alice_api, "zone b", {**ONE, "resources": {"labels": "zone=b"}}).json()["id"]
    gpu_only = submit(alice_api, "gpu", {**ONE, "resources": {"device": "gpu"}}).json()["id"]
    anywhere = submit(alice_api, "any", {**ONE, "resources": {"device": "any"}}).json()["id"]
    on_cpu = submit(alice_api, "cpu", {**ONE, "resources": {"device": "cpu", "labels": "zone=a"}}).json()["id"]
    placed = schedule(RUNS_SIDE)
    assert placed_on(first) == ["gpu-a:0"] and placed_on(in_b) == ["gpu-b:0"]
    assert gpu_only not in placed and Run.objects.get(pk=gpu_only).status_reason.startswith("waiting: needs 1 GPU, 0 free")
    assert placed_on(anywhere)[0].startswith("cpu:") and placed_on(on_cpu)[0].startswith("cpu:")
    bad = submit(alice_api, "bad", {**ONE, "resources": {"device": "tpu"}})
    assert bad.status_code == 400
    assert bad.json() == {"spec": {"resources": {"device": ["must be gpu, cpu or any (empty: gpu where the cluster has GPUs); got 'tpu'"]}}}


def test_the_queue_shows_every_run_in_order_with_why_it_waits_and_hides_names_it_may_not_show(alice, bob, alice_api, bob_api):
    add_host("c", 1)
    first = submit(alice_api, "mine", ONE).json()["id"]
    second = submit(bob_api, "bobs secret", ONE).json()["id"]
    schedule(RUNS_SIDE)
    queue = alice_api.get("/api/queue/").json()
    assert [(e["position"], e["id"], e["name"], e["owner"]) for e in queue] == [(1, second, None, "bob")]
    assert queue[0]["status_reason"].startswith("waiting: needs 1 CPU slot, 0 free; holds c:0 in reserve until run")
    assert queue[0]["reservation"]["devices"] == ["c:0"] and queue[0]["reservation"]["until"] == [first]
    assert bob_api.get("/api/queue/").json()[0]["name"] == "bobs secret"


def test_a_higher_priority_run_that_cannot_start_preempts_a_lower_one_which_checkpoints_and_queues_again(
    alice, bob, alice_api, bob_api, staff_api, django_capture_on_commit_callbacks
):
    purge_host_queues()
    add_host("a", 2)
    low = submit(bob_api, "low", {"layout": {"dp": 2}, "train": {"steps": 100, "warmup_steps": 2}}).json()["id"]
    assert schedule(RUNS_SIDE) == [low]
    Run.objects.filter(pk=low).update(status=Run.Status.RUNNING, started_at=timezone.now(), step=7, token_launch=1)
    staff_api.post("/api/quotas/", {"user": "alice", "priority_ceiling": 5}, format="json")
    high = submit(alice_api, "high", {"layout": {"dp": 2}, "train": {"steps": 4, "warmup_steps": 2}}, priority=5).json()["id"]
    with django_capture_on_commit_callbacks(execute=True):
        assert schedule(RUNS_SIDE) == []
    preempted = Run.objects.get(pk=low)
    assert preempted.preempted_by_id == high
    assert preempted.events.get(kind="preempt_requested").data == {
        "by": high, "priority": 5, "reason": f"preempted by run {high} (priority 5 over 0)",
    }  # fmt: skip
    folder = str(preempted.folder.relative_to(settings.DATA_DIR))
    asked = [kwargs for task, kwargs in host_tasks("host.a") if task == "hostworker.tasks.request_stop"]
    assert asked[0] == {"folder": folder, "name": "stop-request", "reason": f"preempted by run {high} (priority 5 over 0)"}
    assert Run.objects.get(pk=high).reservation["until"] == [low]
    # Its ranks checkpoint step 9, the step they agreed on; its agent says so and exits.
    stopped = {"seq": 1, "kind": "stopped", "data": {"step": 9, "reason": "checkpointed step 9 as the scheduler asked"}}
    services.do_ingest_events(preempted, "node-0", [stopped])
    requeued = Run.objects.get(pk=low)
    assert (requeued.status, requeued.resume, requeued.preempted_by_id) == ("queued", True, None)
    assert requeued.status_reason == f"preempted by run {high}; resumes from step 9"
    assert [e.kind for e in requeued.events.order_by("seq")][-3:] == ["stopped", "preempted", "queued"]
    # Host a's beat lists no agent of it: its devices go back, and the high run takes them.
    assert schedule(RUNS_SIDE) == [high]
    assert Run.objects.get(pk=low).status_reason.startswith("waiting: needs 2 CPU slots")
    purge_host_queues()


def test_a_project_staff_keep_from_preemption_is_never_preempted(alice, bob, alice_api, bob_api, staff_api):
    add_host("a", 2)
    project = Project.objects.create(owner=bob, name="protected")
    staff_api.post("/api/quotas/", {"project": project.pk, "preemptible": False}, format="json")
    low = submit(bob_api, "low", {"layout": {"dp": 2}, "train": {"steps": 100, "warmup_steps": 2}}, project=project.pk).json()["id"]
    assert schedule(RUNS_SIDE) == [low]
    staff_api.post("/api/quotas/", {"user": "alice", "priority_ceiling": 5}, format="json")
    high = submit(alice_api, "high", {"layout": {"dp": 2}}, priority=5).json()["id"]
    assert schedule(RUNS_SIDE) == []
    assert Run.objects.get(pk=low).preempted_by_id is None
    assert Run.objects.get(pk=high).reservation["until"] == [low]  # it waits for the run to end


def test_a_run_whose_ranks_no_device_holds_is_refused_with_the_numbers_and_one_that_fits_only_a_busy_host_waits(alice, alice_api):
    add_host("small-gpus", 2, "gpu")
    Host.objects.filter(name="small-gpus").update(devices=[{"index": i, "kind": "gpu", "memory_mb": 2048} for i in range(2)])
    refused = alice_api.post("/api/runs/", {"name": "too big", "recipe": "small"}, format="json")
    assert refused.status_code == 400
    (message,) = refused.json()["spec"]["layout"]
    assert message.startswith("each rank needs about 4.2 GiB on a GPU, and the largest has 2.0 GiB (the planner's estimate)")
    assert not Run.objects.exists()
    big = add_host("big-gpus", 1, "gpu")
    Host.objects.filter(pk=big.pk).update(devices=[{"index": 0, "kind": "gpu", "memory_mb": 8192}])
    first = alice_api.post("/api/runs/", {"name": "first", "recipe": "small"}, format="json").json()["id"]
    second = alice_api.post("/api/runs/", {"name": "second", "recipe": "small"}, format="json").json()["id"]
    assert Run.objects.get(pk=first).rank_memory_mb == {"gpu": 4283, "cpu": 1519}
    assert schedule(RUNS_SIDE) == [first]
    assert placed_on(first) == ["big-gpus:0"]
    # Two small GPUs are free, but neither holds a rank of it: it waits for the big one.
    reason = Run.objects.get(pk=second).status_reason
    assert reason.startswith("waiting: needs 1 GPU, 0 free, of hosts whose devices hold one of its ranks (4.2 GiB on a GPU)")
    assert DeviceClaim.objects.filter(host__name="small-gpus").count() == 0
