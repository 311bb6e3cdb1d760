"""Gang placement on registered hosts: all nodes or none, never a device twice, a queue in
priority then FIFO order with a visible reason, a 400 for a run that can never fit, devices
back when a run ends. On the real database; start tasks are read off the broker's host queues."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import subprocess
import time
from datetime import timedelta
from typing import IO

import pytest
import redis
from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from controlplane.bulk import insert_rows
from deployments import scaling
from deployments import services as deployment_services
from deployments.autoscaling import Autoscaling, Decision
from deployments.models import Deployment, Replica
from deployments.options import host_refusal
from deployments.tasks import reconcile_deployments
from hosts import services as host_services
from hosts.models import DeviceClaim, Host, Quota
from hosts.replica_placement import place_deployment
from hosts.scheduling import orphans_on, release_ended_claims
from hosts.tasks import schedule_and_start, watch_hosts
from launch import run_agents
from runs import services
from runs.models import Checkpoint, Run
from runs.tasks import LAUNCH_GRACE, launch_run, reconcile_runs
from serving.vllm import ReplicaOptions
from tests.platform.conftest import purge_broker
from tests.platform.test_run_lifecycle import wait_until

pytestmark = pytest.mark.django_db

DP2_TWO_NODES = {
    "layout": {"dp": 2},
    "nodes": {"min": 2, "max": 2, "nproc_per_node": 1},
    "train": {"steps": 4, "warmup_steps": 2},
}


def add_host(name: str, slots: int, address: str, kind: str = "cpu") -> Host:
    return Host.objects.create(name=name, address=address, devices=[{"index": i, "kind": kind} for i in range(slots)])


def submit(api, name: str, spec: dict, **extra):
    return api.post("/api/runs/", {"name": name, "spec": spec, **extra}, format="json")


def _queued_messages(queue: str) -> list[dict]:
    if settings.CELERY_BROKER_URL.startswith("filesystem://"):
        paths = sorted((settings.BROKER_DIR / "queue").glob(f"*.{queue}.msg"))
        return [json.loads(path.read_text()) for path in paths]
    # Redis: kombu keeps a queue as a list, newest first.
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    return [json.loads(raw) for raw in reversed(broker.lrange(queue, 0, -1))]


def host_tasks(queue: str) -> list[tuple[str, dict]]:
    """(task name, kwargs) of each message waiting on a host's queue of the broker."""
    found = []
    for message in _queued_messages(queue):
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        found.append((message["headers"]["task"], kwargs))
    return found


def purge_host_queues() -> None:
    purge_broker()
    if not settings.CELERY_BROKER_URL.startswith("filesystem://"):
        redis.Redis.from_url(settings.CELERY_BROKER_URL).delete("host.a", "host.b", "host.c")


@pytest.fixture
def real_store() -> None:
    """A test that asks for it gets the real rendezvous store of each run it starts."""


@pytest.fixture(autouse=True)
def store_stand_ins(request, monkeypatch):
    """A run on several hosts gets its rendezvous store on this machine (`run_agents.start_store_here`);
    here the test holds the store's lock instead, where a torch store would idle for two minutes
    after each test."""
    if "real_store" in request.fixturenames:
        yield
        return
    held: list[IO[str]] = []

    def stand_in(run: Run, launch: int) -> None:
        lock = run.run_dir.rendezvous_store_lock(launch)
        lock.parent.mkdir(parents=True, exist_ok=True)
        held.append(lock.open("a"))
        with contextlib.suppress(BlockingIOError):  # as `flock -n`: the launch's store runs already
            fcntl.flock(held[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)

    monkeypatch.setattr(run_agents, "start_store_here", stand_in)
    yield
    for lock in held:
        lock.close()


@pytest.fixture
def two_hosts():
    purge_host_queues()
    yield add_host("a", 1, "10.9.0.11"), add_host("b", 1, "10.9.0.12")
    purge_host_queues()


def test_a_two_node_run_is_placed_one_node_per_host_and_its_agents_start_there(alice_api, two_hosts, real_store):
    response = submit(alice_api, "spans", DP2_TWO_NODES)
    assert response.status_code == 201, response.json()
    run_id = response.json()["id"]
    # The submit queued its launch; the scheduling pass is what the launch task runs.
    assert schedule_and_start() == [run_id]
    run = Run.objects.get(pk=run_id)
    assert run.status == "starting"
    claims = list(DeviceClaim.objects.filter(run=run).values_list("node", "host__name", "device"))
    assert sorted(claims) == [(0, "a", 0), (1, "b", 0)]
    placed = run.events.get(kind="placed").data["nodes"]
    assert [(n["node"], n["host"], n["devices"]) for n in placed] == [(0, "a", [0]), (1, "b", [0])]
    # The rendezvous store runs here, on the control plane, where no host's loss takes it along;
    # each host is sent its agent, which is told its own address.
    assert run.rendezvous.startswith(f"{settings.RENDEZVOUS_ADDRESS}:")
    try:
        wait_until(lambda: run_agents.store_running_here(run, run.launch_attempts), 60, "the run's store here")
    finally:
        subprocess.run(["pkill", "-f", "--", f"--endpoint {run.rendezvous}"], check=False)
    tasks_a, tasks_b = host_tasks("host.a"), host_tasks("host.b")
    assert [t[1]["module"] for t in tasks_a] == [t[1]["module"] for t in tasks_b] == ["training.agent"]
    assert {t[0] for t in tasks_a + tasks_b} == {"hostworker.tasks.start_process"}
    agent_b = tasks_b[0][1]
    assert tasks_a[0][1]["args"][-2:] == agent_b["args"][-2:] == ["--host-store", "no"]
    assert agent_b["devices"] == [0] and agent_b["device_kind"] == "cpu"
    args = agent_b["args"]
    assert args[args.index("--rdzv-endpoint") + 1] == run.rendezvous
    assert args[args.index("--local-addr") + 1] == "10.9.0.12"
    assert args[args.index("--node-rank") + 1] == "1"
    assert args[args.index("--events-url") + 1].startswith(settings.PUBLIC_URL)
    assert args[args.index("--logs-url") + 1] == f"{settings.PUBLIC_URL}/api/runs/{run_id}/shipped-logs/"
    # The host keeps the run's folder under its own data folder ({folder}) and gets the spec
    # with the task: no path of ours reaches it.
    assert agent_b["folder"] == f"runs/{run.folder.name}"
    assert json.loads(agent_b["files"]["spec.json"]) == run.spec
    assert (args[args.index("--spec") + 1], args[args.index("--run-dir") + 1]) == ("{folder}/spec.json", "{folder}")
    assert (agent_b["lock"], agent_b["log"]) == ("{folder}/agent-node1.lock", "{folder}/logs/agent-node1.log")
    assert str(settings.DATA_DIR) not in json.dumps([kwargs for _, kwargs in tasks_a + tasks_b])


def test_a_run_that_can_never_fit_the_cluster_is_refused_naming_why(alice_api, two_hosts):
    spec = {"layout": {"dp": 4}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 2}}
    response = submit(alice_api, "too big", spec)
    assert response.status_code == 400
    message = response.json()["spec"]["nodes"][0]
    assert (
        "needs 2 nodes × 2 CPU slots" in message
        and "2 CPU hosts with 2 CPU slots in all, at most 1 on one host" in message
    )
    three_nodes = {
        "layout": {"dp": 3},
        "train": {"global_batch": 6},
        "nodes": {"min": 3, "max": 3, "nproc_per_node": 1},
    }
    assert "2 CPU hosts" in submit(alice_api, "three", three_nodes).json()["spec"]["nodes"][0]
    # The launch form's check says the same.
    assert alice_api.post("/api/runs/check/", {"spec": spec}, format="json").status_code == 400
    assert not Run.objects.exists()


def test_without_hosts_any_run_is_accepted_as_before(alice_api):
    spec = {"layout": {"dp": 4}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 2}}
    assert submit(alice_api, "local", spec).status_code == 201


def test_runs_wait_in_priority_then_fifo_order_with_a_reason_and_take_the_devices_an_ended_run_frees(
    alice, alice_api, two_hosts
):
    first = submit(alice_api, "first", DP2_TWO_NODES).json()["id"]
    second = submit(alice_api, "second", DP2_TWO_NODES).json()["id"]
    third = submit(alice_api, "third", {"train": {"steps": 4, "warmup_steps": 2}}).json()["id"]
    assert schedule_and_start() == [first]
    queued = {r["id"]: r for r in alice_api.get("/api/runs/?status=queued").json()["results"]}
    assert queued[second]["status_reason"] == (
        f"waiting: needs 2 CPU slots (2 nodes × 1, each node on one host), 0 free; holds a:0, b:0 in reserve until run {first} ends"
    )
    assert queued[second]["reservation"] == {"devices": ["a:0", "b:0"], "until": [first], "expected_at": None}
    # The one-slot run would fit no better than the head of the queue, and does not jump it.
    assert queued[third]["status_reason"] == (
        f"waiting: behind run {second} at the head of the queue; the devices it leaves free do not fit this run"
    )
    assert queued[third]["reservation"] == {}
    assert Run.objects.get(pk=second).events.filter(kind="waiting").count() == 1
    assert schedule_and_start() == []
    assert Run.objects.get(pk=second).events.filter(kind="waiting").count() == 1  # said once

    Quota.objects.create(user=alice, priority_ceiling=5)  # staff let her submit up to 5
    urgent = submit(alice_api, "urgent", {"train": {"steps": 4, "warmup_steps": 2}}, priority=5).json()["id"]
    # The first run ends: its devices go back at once, and the queue moves in order.
    services.do_set_status(Run.objects.get(pk=first), Run.Status.FAILED, "node lost")
    assert not DeviceClaim.objects.filter(run_id=first).exists()
    assert schedule_and_start() == [urgent]  # priority first; the second run no longer fits beside it
    assert Run.objects.get(pk=second).status_reason.startswith("waiting: needs 2 CPU slots")
    assert Run.objects.get(pk=second).reservation["until"] == [urgent]
    services.do_set_status(Run.objects.get(pk=urgent), Run.Status.SUCCEEDED)
    assert schedule_and_start() == [second]
    assert Run.objects.get(pk=third).status == "queued"


def test_cancelling_a_placed_run_sends_stop_to_each_of_its_hosts_and_frees_its_devices(
    alice_api, two_hosts, django_capture_on_commit_callbacks
):
    run_id = submit(alice_api, "spans", DP2_TWO_NODES).json()["id"]
    schedule_and_start()
    purge_host_queues()
    with django_capture_on_commit_callbacks(execute=True):
        services.do_cancel_run(Run.objects.get(pk=run_id))
    assert host_tasks("host.a") == [("hostworker.tasks.stop_process", {"key": f"run-{run_id}-node-0"})]
    assert host_tasks("host.b") == [("hostworker.tasks.stop_process", {"key": f"run-{run_id}-node-1"})]
    assert not Run.objects.get(pk=run_id).run_dir.cancel_marker.exists()  # a host could not see it
    # The agents say `cancelled`; the run ends and its devices are free.
    services.do_set_status(Run.objects.get(pk=run_id), Run.Status.CANCELLED, "cancelled")
    assert not DeviceClaim.objects.exists()


def test_a_draining_or_lost_host_is_given_nothing(alice_api, two_hosts):
    a, _ = two_hosts
    Host.objects.filter(pk=a.pk).update(status=Host.Status.DRAINING)
    run_id = submit(alice_api, "one", {"train": {"steps": 4, "warmup_steps": 2}}).json()["id"]
    assert schedule_and_start() == [run_id]
    assert set(DeviceClaim.objects.values_list("host__name", flat=True)) == {"b"}


def test_nodes_spread_over_hosts_while_they_can_and_share_one_when_they_must(alice_api):
    purge_host_queues()
    add_host("a", 3, "10.9.0.11"), add_host("b", 1, "10.9.0.12")
    spread = submit(alice_api, "spread", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [spread]
    # Best fit first (b, the smaller hole), then another host rather than b again.
    claims = sorted(DeviceClaim.objects.filter(run_id=spread).values_list("node", "host__name", "device"))
    assert claims == [(0, "b", 0), (1, "a", 0)]
    shared = submit(alice_api, "shared", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [shared]
    claims = sorted(DeviceClaim.objects.filter(run_id=shared).values_list("node", "host__name", "device"))
    assert claims == [(0, "a", 1), (1, "a", 2)]
    purge_host_queues()


def test_a_lost_host_is_a_lost_node_the_run_goes_on_without_or_resumes_from_when_it_must(
    alice_api, two_hosts, settings, django_capture_on_commit_callbacks
):
    settings.HOST_LOST_AFTER_SECONDS = 15
    elastic = {**DP2_TWO_NODES, "nodes": {"min": 1, "max": 2, "nproc_per_node": 1}}
    goes_on = submit(alice_api, "elastic", elastic).json()["id"]
    assert schedule_and_start() == [goes_on]
    Host.objects.update(last_seen=timezone.now())
    Host.objects.filter(name="b").update(last_seen=timezone.now() - timedelta(seconds=16))
    purge_host_queues()
    assert watch_hosts() == ["b"]
    run = Run.objects.get(pk=goes_on)
    assert run.status == "starting"
    assert run.events.get(kind="host_lost").data == {
        "host": "b",
        "address": "10.9.0.12",
        "nodes": ["node-1"],
        "nodes_left": 1,
        "continues": True,
    }
    services.do_set_status(run, Run.Status.SUCCEEDED)

    rigid = submit(alice_api, "rigid", DP2_TWO_NODES).json()["id"]
    Host.objects.filter(name="b").update(status=Host.Status.READY, last_seen=timezone.now())
    assert schedule_and_start() == [rigid]
    Host.objects.filter(name="b").update(last_seen=timezone.now() - timedelta(seconds=16))
    purge_host_queues()
    with django_capture_on_commit_callbacks(execute=True):
        assert watch_hosts() == ["b"]
    run = Run.objects.get(pk=rigid)
    assert run.events.get(kind="host_lost").data["continues"] is False
    # Stopped where it still ran, failed with the reason, queued again to resume from its checkpoint.
    assert ("hostworker.tasks.stop_process", {"key": f"run-{rigid}-node-0"}) in host_tasks("host.a")
    assert all(task != "hostworker.tasks.stop_process" for task, _ in host_tasks("host.b"))
    statuses = [e.data["status"] for e in run.events.filter(kind__in=["status", "queued"]).order_by("seq")]
    assert statuses[-2:] == ["failed", "queued"]
    assert (run.status, run.resume) == ("queued", True)
    # b is lost and a has one slot: it waits, saying so.
    assert run.status_reason == "waiting: needs 2 CPU slots (2 nodes × 1, each node on one host), 1 free"
    # The agent stopped on a reports its cancel: the run it belonged to still waits to resume.
    services.do_ingest_events(run, "node-0", [{"seq": 1, "kind": "cancelled", "data": {"step": 0}}])
    assert Run.objects.get(pk=rigid).status == "queued"


def test_an_ended_runs_devices_go_to_new_work_only_once_its_hosts_no_longer_run_its_agents(
    alice_api, two_hosts, django_capture_on_commit_callbacks
):
    first = submit(alice_api, "first", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [first]
    agents = {"a": f"run-{first}-node-0", "b": f"run-{first}-node-1"}
    for name, key in agents.items():
        Host.objects.filter(name=name).update(running=[{"key": key, "pid": 1, "launch": 1}])
    second = submit(alice_api, "second", DP2_TWO_NODES).json()["id"]
    # The agents report the run's end while they, and their ranks, still exit.
    services.do_set_status(Run.objects.get(pk=first), Run.Status.SUCCEEDED)
    assert DeviceClaim.objects.filter(run_id=first).count() == 2
    assert schedule_and_start() == []
    # Host a's beat no longer lists its agent, and queues a pass: a's device goes back there, b's
    # stays with the old run.
    purge_broker()
    with django_capture_on_commit_callbacks(execute=True):
        host_services.do_heartbeat("a", "10.9.0.11", [{"index": 0, "kind": "cpu"}], {}, [])
    assert [m["headers"]["task"] for m in _queued_messages("celery")] == ["hosts.tasks.schedule_runs"]
    assert schedule_and_start() == []
    assert list(DeviceClaim.objects.filter(run_id=first).values_list("host__name", flat=True)) == ["b"]
    Host.objects.filter(name="b").update(running=[])
    assert schedule_and_start() == [second]


def test_losing_node_0s_host_is_losing_a_node_like_any_other(alice_api, two_hosts, settings):
    settings.HOST_LOST_AFTER_SECONDS = 15
    elastic = {**DP2_TWO_NODES, "nodes": {"min": 1, "max": 2, "nproc_per_node": 1}}
    running = submit(alice_api, "running", elastic).json()["id"]
    assert schedule_and_start() == [running]
    assert dict(DeviceClaim.objects.filter(run_id=running).values_list("node", "host__name")) == {0: "a", 1: "b"}
    Host.objects.update(last_seen=timezone.now())
    Host.objects.filter(name="a").update(last_seen=timezone.now() - timedelta(seconds=16))
    purge_host_queues()
    assert watch_hosts() == ["a"]
    # Its store is on the control plane: node 1's agent meets there again alone, and the run
    # goes on, neither stopped nor queued again.
    run = Run.objects.get(pk=running)
    assert (run.status, run.resume) == ("starting", False)
    assert run.events.get(kind="host_lost").data == {
        "host": "a", "address": "10.9.0.11", "nodes": ["node-0"], "nodes_left": 1, "continues": True,
    }  # fmt: skip
    assert host_tasks("host.b") == []


def test_a_deployments_replicas_spread_over_hosts_a_device_each_and_give_them_back(alice, alice_api, two_hosts):
    run = Run.objects.create(owner=alice, name="done", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(
        owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=3
    )
    # Two hosts of one slot each: three replicas do not fit, and nothing is claimed.
    assert place_deployment(deployment.pk, 3, "cpu") == "needs 3 CPU slots free on ready hosts, one per replica; 2 free now"
    assert not DeviceClaim.objects.exists()
    groups = place_deployment(deployment.pk, 2, "cpu")
    assert [(g.host.name, g.devices, g.first_replica) for g in groups] == [("a", [0], 0), ("b", [0], 1)]
    claims = DeviceClaim.objects.filter(deployment=deployment).values_list("host__name", "device", "node")
    assert sorted(claims) == [("a", 0, 0), ("b", 0, 1)]
    # A run of two nodes now waits for the slots the replicas hold.
    waiting = submit(alice_api, "waits", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == []
    assert Run.objects.get(pk=waiting).status_reason.endswith(", 0 free")
    # Stopped, its supervisors still run on both hosts (their beats list them): the slots stay held.
    Host.objects.update(running=[{"key": f"deployment-{deployment.pk}", "pid": 7}])
    deployment_services.do_set_status(deployment, Deployment.Status.STOPPED, only_from=Deployment.Status.values)
    assert schedule_and_start() == []
    assert DeviceClaim.objects.filter(deployment=deployment).count() == 2
    # Once the hosts' beats no longer list them, the slots go back and the run takes them.
    Host.objects.update(running=[])
    assert schedule_and_start() == [waiting]
    assert not DeviceClaim.objects.filter(deployment=deployment).exists()


def test_a_host_running_a_supervisor_no_claim_covers_gets_nothing_new_and_is_told_to_stop_it(alice, alice_api, two_hosts):
    run = Run.objects.create(owner=alice, name="done", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    gone = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", status="failed")
    # Host b came back from being lost with that deployment's supervisor still running.
    Host.objects.filter(name="b").update(running=[{"key": f"deployment-{gone.pk}", "pid": 7}])
    b = Host.objects.get(name="b")
    assert orphans_on(b) == [f"deployment-{gone.pk}"]
    waiting = submit(alice_api, "waits", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == []  # b's slot may be held by that replica
    assert Run.objects.get(pk=waiting).status_reason.endswith(", 1 free")
    assert host_services.do_stop_orphans(b) == [f"deployment-{gone.pk}"]
    assert ("hostworker.tasks.stop_process", {"key": f"deployment-{gone.pk}"}) in host_tasks("host.b")
    Host.objects.filter(name="b").update(running=[])  # its next beat: stopped
    assert schedule_and_start() == [waiting]


def exported_checkpoint(owner, tmp_path) -> Checkpoint:
    """A finished run's checkpoint with an export folder (its config.json is all a supervisor's
    config needs read here)."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")
    run = Run.objects.create(owner=owner, name="done", spec={}, status="succeeded")
    return Checkpoint.objects.create(run=run, step=1, path="/nowhere", export_path=str(export))


def test_losing_one_host_of_a_deployment_degrades_it_and_its_replica_is_placed_again_where_there_is_room(
    alice, two_hosts, tmp_path, django_capture_on_commit_callbacks
):
    checkpoint = exported_checkpoint(alice, tmp_path)
    deployment = Deployment.objects.create(
        owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=2, status="ready"
    )
    for index in (0, 1):
        Replica.objects.create(deployment=deployment, index=index, status="ready")
    assert [(g.host.name, g.replicas) for g in place_deployment(deployment.pk, 2, "cpu")] == [("a", [0]), ("b", [1])]
    Host.objects.filter(name="b").update(last_seen=timezone.now() - timedelta(seconds=60))
    add_host("c", 1, "10.9.0.13")
    purge_broker()
    with django_capture_on_commit_callbacks(execute=True):
        assert watch_hosts() == ["b"]
    # Marking the host lost sends the reconcile at once, not at its next tick.
    assert [task for task, _ in host_tasks("celery")] == ["deployments.tasks.reconcile_deployments"]
    with django_capture_on_commit_callbacks(execute=True):
        assert reconcile_deployments() == 0
    deployment.refresh_from_db()
    assert (deployment.status, deployment.status_reason) == ("degraded", "host b was lost with replica 1")
    assert dict(Replica.objects.filter(deployment=deployment).values_list("index", "status")) == {0: "ready", 1: "dead"}
    # Replica 1 was placed again on c, the host with room, and its supervisor sent there.
    claims = sorted(DeviceClaim.objects.filter(deployment=deployment).values_list("host__name", "node"))
    assert claims == [("a", 0), ("c", 1)]
    started = [kwargs for task, kwargs in host_tasks("host.c") if task == "hostworker.tasks.start_process"]
    assert [k["key"] for k in started] == [f"deployment-{deployment.pk}"]
    assert json.loads(started[0]["files"]["deployment.json"])["first_replica"] == 1
    assert list(deployment.events.filter(kind__in=["host_lost", "placed"]).values_list("kind", flat=True)) == [
        "host_lost", "placed"
    ]
    # Losing its last host fails it, naming the hosts.
    Host.objects.filter(name__in=["a", "c"]).update(status=Host.Status.LOST)
    assert reconcile_deployments() == 1
    deployment.refresh_from_db()
    assert (deployment.status, deployment.status_reason) == ("failed", "host a, c was lost with replicas 0, 1")


def test_replicas_beyond_one_per_host_share_a_host_under_consecutive_numbers(alice):
    purge_host_queues()
    add_host("big", 2, "10.9.0.21")
    add_host("small", 1, "10.9.0.22")
    run = Run.objects.create(owner=alice, name="done", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=3)
    groups = place_deployment(deployment.pk, 3, "cpu")
    # One replica per host first (the fuller host first: best fit), then the host with room takes
    # the third; each host's replicas are numbered in a row, for its one supervisor.
    assert [(g.host.name, g.devices, g.first_replica) for g in groups] == [("small", [0], 0), ("big", [0, 1], 1)]
    assert sorted(DeviceClaim.objects.filter(deployment=deployment).values_list("node", flat=True)) == [0, 1, 2]


def test_int4_replicas_go_only_to_hosts_whose_cpu_has_the_kernel_and_the_others_are_named(alice):
    purge_host_queues()
    Host.objects.create(name="avx2", address="10.9.0.51", devices=[{"index": i, "kind": "cpu"} for i in range(4)],
                        cpu_flags=["avx", "avx2", "fma"])  # fmt: skip
    Host.objects.create(name="avx512", address="10.9.0.52", devices=[{"index": 0, "kind": "cpu"}],
                        cpu_flags=["avx", "avx2", "avx512f", "fma"])  # fmt: skip
    run = Run.objects.create(owner=alice, name="done", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=2)
    int4 = ReplicaOptions(device="cpu", quantization="int4", dtype="bfloat16")

    def refusal(host: Host) -> str | None:
        return host_refusal(int4, host)

    # The AVX2 host's four free slots do not count: its vLLM build has no 4-bit kernel.
    assert place_deployment(deployment.pk, 2, "cpu", refusal=refusal) == (
        "needs 2 CPU slots free on ready hosts, one per replica; 1 free now; left out: host avx2: 'int4' on cpu "
        "needs AVX-512: vLLM's CPU build has its 4-bit kernel only for AVX-512 CPUs, and this one has AVX2 at most; "
        "serve 'int8_w8a8' or the float model"
    )
    assert not DeviceClaim.objects.exists()
    groups = place_deployment(deployment.pk, 1, "cpu", refusal=refusal)
    assert [(g.host.name, g.devices) for g in groups] == [("avx512", [0])]
    # The float model runs anywhere: the emptier AVX2 host is fine for it.
    float_model = ReplicaOptions(device="cpu")
    other = Deployment.objects.create(owner=alice, name="f", checkpoint=checkpoint, served_model_name="f", replicas=1)
    groups = place_deployment(other.pk, 1, "cpu", refusal=lambda host: host_refusal(float_model, host))
    assert [g.host.name for g in groups] == ["avx2"]


def test_tensor_parallel_replicas_take_their_gpus_on_one_host_each(alice):
    purge_host_queues()
    add_host("g8", 8, "10.9.0.31", kind="gpu")
    add_host("g2", 2, "10.9.0.32", kind="gpu")
    run = Run.objects.create(owner=alice, name="done", spec={}, status="succeeded")
    checkpoint = Checkpoint.objects.create(run=run, step=1, path="/nowhere")
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=3)
    # Four GPUs per replica: only g8 has room, for two.
    assert place_deployment(deployment.pk, 3, "gpu", per_replica=4) == (
        "needs 3 replicas × 4 GPUs free on one host each (tensor_parallel_size); the ready hosts have room for 2 now"
    )
    groups = place_deployment(deployment.pk, 3, "gpu", per_replica=2)
    # Spread first (best fit puts replica 0 on the fuller g2), then g8 takes two replicas of two GPUs.
    assert [(g.host.name, g.devices, g.replicas) for g in groups] == [("g2", [0, 1], [0]), ("g8", [0, 1, 2, 3], [1, 2])]
    claims = DeviceClaim.objects.filter(deployment=deployment).values_list("host__name", "device", "node")
    assert sorted(claims) == [("g2", 0, 0), ("g2", 1, 0), ("g8", 0, 1), ("g8", 1, 1), ("g8", 2, 2), ("g8", 3, 2)]


def test_reconcile_leaves_waiting_runs_to_the_scheduler_once_hosts_exist(alice_api, two_hosts):
    first = submit(alice_api, "first", DP2_TWO_NODES).json()["id"]
    waiting = submit(alice_api, "waiting", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [first]
    Run.objects.filter(pk=waiting).update(created_at=timezone.now() - timedelta(minutes=5))
    purge_host_queues()
    reconcile_runs()
    # Without hosts it re-sends launches a dead worker lost; here a waiting run only waits.
    assert [m for m in _queued_messages("celery") if m["headers"]["task"] == "runs.tasks.launch_run"] == []


def test_a_placed_run_whose_agents_never_started_is_sent_again_unless_it_was_cancelled(alice_api, two_hosts):
    run_id = submit(alice_api, "lost start", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [run_id]
    # Its start tasks were lost (a broker without redelivery, a dead host worker): past the
    # grace, the launch task (as reconcile re-sends it) sends them again, with a new launch number.
    purge_host_queues()
    Run.objects.filter(pk=run_id).update(last_report_at=timezone.now() - LAUNCH_GRACE * 2)
    assert launch_run(run_id) == f"run {run_id}: start tasks sent again"
    assert [kwargs["launch"] for _, kwargs in host_tasks("host.b")] == [2]
    # Cancelled meanwhile: it ends instead, and its devices go back.
    purge_host_queues()
    Run.objects.filter(pk=run_id).update(cancel_requested=True, last_report_at=timezone.now() - LAUNCH_GRACE * 2)
    launch_run(run_id)
    assert Run.objects.get(pk=run_id).status == "cancelled"
    assert host_tasks("host.a") == host_tasks("host.b") == []
    assert not DeviceClaim.objects.exists()


def test_a_placed_run_that_one_host_never_got_the_start_of_gets_its_launch_sent_again(alice_api, two_hosts):
    run_id = submit(alice_api, "half started", DP2_TWO_NODES).json()["id"]
    assert schedule_and_start() == [run_id]
    sent = {kwargs["key"]: kwargs for _, kwargs in host_tasks("host.a") + host_tasks("host.b")}
    # The store here and host a's node 0 agent started (they wait at the rendezvous); host b's
    # start task was lost, as a broker restart loses it.
    purge_host_queues()
    Host.objects.filter(name="a").update(running=[{"key": f"run-{run_id}-node-0", "pid": 1, "launch": 1}])
    reconcile_runs()
    assert host_tasks("host.b") == []  # within the grace: its start may still be on its way
    Run.objects.get(pk=run_id).events.filter(kind="placed").update(time=timezone.now() - LAUNCH_GRACE * 2)
    reconcile_runs()
    # The same launch again, with the token node 0's agent already holds: host b starts node 1,
    # host a starts nothing new (a start it runs for that launch is a no-op there).
    again = {kwargs["key"]: kwargs for _, kwargs in host_tasks("host.a") + host_tasks("host.b")}
    assert again == sent
    assert Run.objects.get(pk=run_id).launch_attempts == 1
    token = next(arg for arg in sent[f"run-{run_id}-node-1"]["args"] if arg.startswith("--run-token="))
    assert token.removeprefix("--run-token=") == run_agents.node_token(run_id, 1, 1)
    assert Run.objects.get(pk=run_id).token_launch == 1
    # Once every host runs its part, nothing is sent.
    purge_host_queues()
    Host.objects.filter(name="b").update(running=[{"key": f"run-{run_id}-node-1", "pid": 1, "launch": 1}])
    reconcile_runs()
    assert host_tasks("host.a") == host_tasks("host.b") == []
    assert Run.objects.get(pk=run_id).status == "starting"


def test_the_database_refuses_a_device_given_twice(django_user_model):
    host = add_host("a", 1, "10.9.0.11")
    owner = django_user_model.objects.create(username="o")
    runs = [Run.objects.create(owner=owner, name=f"r{i}", spec={}) for i in range(2)]
    DeviceClaim.objects.create(host=host, device=0, run=runs[0], node=0)
    with pytest.raises(IntegrityError), transaction.atomic():
        DeviceClaim.objects.create(host=host, device=0, run=runs[1], node=0)
    # The way a pass writes its claims (COPY on PostgreSQL) is refused the same way, and whole.
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    fields = ["host", "device", "run", "node", "claimed_at"]
    with pytest.raises(IntegrityError), transaction.atomic():
        insert_rows(DeviceClaim, fields, [(host.pk, 1, runs[1].pk, 0, now), (host.pk, 0, runs[1].pk, 0, now)])
    assert list(DeviceClaim.objects.values_list("device", "run")) == [(0, runs[0].pk)]
    insert_rows(DeviceClaim, fields, [(host.pk, 1, runs[1].pk, 0, now)])
    assert DeviceClaim.objects.get(device=1).run == runs[1]


def test_an_autoscaled_deployment_on_hosts_gets_its_added_replica_placed_where_none_runs_and_a_removed_ones_host_stopped(
    alice, two_hosts, tmp_path, django_capture_on_commit_callbacks
):
    checkpoint = exported_checkpoint(alice, tmp_path)
    policy = Autoscaling(min_replicas=1, max_replicas=2, target_waiting=1, window_s=0.01, cooldown_s=0.01)
    deployment = Deployment.objects.create(
        owner=alice, name="d", checkpoint=checkpoint, served_model_name="d", replicas=1, status="ready",
        autoscaling=policy.to_dict(),
    )  # fmt: skip
    Replica.objects.create(deployment=deployment, index=0, status="ready")
    assert [(g.host.name, g.replicas) for g in place_deployment(deployment.pk, 1, "cpu")] == [("a", [0])]
    purge_host_queues()

    def scrapes(metrics: dict) -> Decision | None:
        """Two scrapes of the same load, the window apart: the second decides."""
        assert scaling.autoscale(deployment, metrics) is None
        time.sleep(0.02)
        with django_capture_on_commit_callbacks(execute=True):
            return scaling.autoscale(deployment, metrics)

    added = scrapes({"replicas_scraped": 1, "running": 8, "waiting": 5})
    assert added is not None and added.replicas == 2
    assert sorted(DeviceClaim.objects.filter(deployment=deployment).values_list("host__name", "node")) == [("a", 0), ("b", 1)]
    assert host_tasks("host.a") == []  # a's supervisor runs on as it was
    (started,) = [kwargs for task, kwargs in host_tasks("host.b") if task == "hostworker.tasks.start_process"]
    config = json.loads(started["files"]["deployment.json"])
    assert (started["key"], config["first_replica"], config["replicas"]) == (f"deployment-{deployment.pk}", 1, 1)
    scaled = deployment.events.get(kind="scaled").data
    assert scaled == {"from": 1, "to": 2, "reason": "5 requests waiting per replica, over the target of 1, for 0 s"}
    assert sorted(Replica.objects.filter(deployment=deployment).values_list("index", flat=True)) == [0, 1]

    # Quiet: the replica on b goes, its host's supervisor is stopped, and b's slot comes back
    # once b's beats no longer list that supervisor.
    Host.objects.filter(name="b").update(running=[{"key": f"deployment-{deployment.pk}", "pid": 7}])
    removed = scrapes({"replicas_scraped": 2, "running": 0, "waiting": 0})
    assert removed is not None and removed.replicas == 1
    assert ("hostworker.tasks.stop_process", {"key": f"deployment-{deployment.pk}"}) in host_tasks("host.b")
    assert host_tasks("host.a") == []
    with transaction.atomic():
        release_ended_claims(list(Host.objects.select_for_update().order_by("pk")))
    assert DeviceClaim.objects.filter(deployment=deployment, host__name="b").exists()
    Host.objects.filter(name="b").update(running=[])
    with transaction.atomic():
        release_ended_claims(list(Host.objects.select_for_update().order_by("pk")))
    assert list(DeviceClaim.objects.filter(deployment=deployment).values_list("host__name", "node")) == [("a", 0)]
    assert list(Replica.objects.filter(deployment=deployment).values_list("index", flat=True)) == [0]
