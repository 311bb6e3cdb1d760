"""Several hosts on one machine: network namespaces the test creates, each running its own host
worker at its own address, against a web process, a Celery worker and a Redis broker that
listen on the test's bridge. A process in a namespace cannot reach the root namespace's
127.0.0.1, so anything that assumed loopback between hosts fails here.

Traffic goes only to loopback and to the addresses of the namespaces and bridge this test
creates (one private /24 that no interface of the machine uses); every wait is bounded; the
namespaces, the bridge and every process in them are removed at the end, also on failure.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import openai
import pytest
from rest_framework.authtoken.models import Token

from controlplane.web import web_command
from hosts.models import Host
from hostworker.processes import is_alive
from runs.models import Run
from tests.platform.conftest import REPO, CeleryWorker, HostWorker, free_port, process_env, stop, wait_for_http
from tests.platform.test_run_lifecycle import wait_until
from tools import netns
from tools.netns import Broker, Network

pytestmark = pytest.mark.slow

TOKEN = "netns-join-token"


@pytest.fixture
def network() -> Iterator[Network]:
    with netns.network() as net:
        yield net


@dataclass
class Cluster:
    url: str
    network: Network
    hosts: list[HostWorker]
    api: httpx.Client
    broker: Broker


@pytest.fixture
def cluster(network, alice, transactional_db, tmp_path, monkeypatch) -> Iterator[Cluster]:
    """Two namespace hosts with two CPU slots each, joined to a control plane on the bridge."""
    with running_cluster(network, alice, tmp_path, monkeypatch) as running:
        yield running


@contextmanager
def running_cluster(
    network: Network, alice, tmp_path: Path, monkeypatch, host_env: Callable[[int], dict[str, str]] = lambda i: {},
    hidden: Path | None = None, host_lost_after: float = 6, cpu_slots: int = 2, core_each: bool = False,
) -> Iterator[Cluster]:
    """The `cluster` fixture's cluster; `host_env(index)` adds to a host worker's environment;
    `hidden`: a folder each host worker (and all it starts) sees as an empty tmpfs of its own;
    `core_each`: host `index` has core `index` of this machine to itself, as two one-core machines
    would (a host's slots otherwise start at core 0 on each: a vLLM worker pins itself to its
    slot's first core, and one started beside a busy replica of the other host got no CPU)."""
    bridge = network.bridge_address
    redis_port, web_port = free_port(), free_port()
    url = f"http://{bridge}:{web_port}"
    # Every process started from here on takes these (process_env copies os.environ).
    monkeypatch.setenv("CELERY_BROKER_URL", f"redis://{bridge}:{redis_port}/0")
    monkeypatch.setenv("ALLOWED_HOSTS", f"{bridge},127.0.0.1,localhost")
    monkeypatch.setenv("FATHOM_JOIN_TOKEN", TOKEN)
    monkeypatch.setenv("FATHOM_HOST_LOST_AFTER", str(host_lost_after))
    monkeypatch.setenv("FATHOM_SCHEDULE_INTERVAL", "1")
    processes: list[subprocess.Popen] = []
    stoppers = []
    try:
        broker = Broker(bridge, redis_port, tmp_path / "redis.log")
        broker.start()
        stoppers.append(broker.stop)
        with (tmp_path / "web.log").open("ab") as out:
            web = subprocess.Popen(
                web_command(web_port, bridge), cwd=REPO / "platform", env=process_env(FATHOM_PUBLIC_URL=url),
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        processes.append(web)
        wait_for_http(f"{url}/login/", process=web)
        worker = CeleryWorker(tmp_path / "worker.log", url, beat=True, supervised=True)  # as compose restarts it
        worker.start()
        stoppers.append(worker.stop)
        hosts = []
        for index in range(2):
            namespace = network.add_namespace()
            host = HostWorker(
                f"h{index}", tmp_path / f"host{index}.log", url, TOKEN, cpu_slots=cpu_slots,
                prefix=["ip", "netns", "exec", namespace, *(netns.hiding(hidden) if hidden else []),
                        *(["taskset", "-c", str(index)] if core_each else [])], **host_env(index),
            )  # fmt: skip
            host.start()
            stoppers.append(host.stop)
            hosts.append(host)
        client = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Token {Token.objects.get_or_create(user=alice)[0].key}"},
            timeout=30,
        )
        wait_until(lambda: Host.objects.filter(status="ready").count() == 2, 120, "both hosts to join")
        wait_until(lambda: all(host.holds_its_secret() for host in hosts), 30, "both hosts to keep their secrets")
        yield Cluster(url, network, hosts, client, broker)
    finally:
        for stopper in reversed(stoppers):
            stopper()
        for process in reversed(processes):
            stop(process)


def losses(run_id: int) -> list[float]:
    return list(
        Run.objects.get(pk=run_id).events.filter(kind="metrics").order_by("seq").values_list("data__loss", flat=True)
    )


def submit(cluster: Cluster, name: str, spec: dict) -> httpx.Response:
    return cluster.api.post("/api/runs/", json={"name": name, "spec": spec})


def wait_finished(run_id: int, timeout: float = 600) -> Run:
    wait_until(lambda: Run.objects.get(pk=run_id).status in Run.FINISHED, timeout, f"run {run_id} to end")
    return Run.objects.get(pk=run_id)


TRAIN = {"steps": 4, "warmup_steps": 2, "checkpoint_interval": 2, "global_batch": 8}


@pytest.mark.django_db(transaction=True)
def test_runs_span_namespace_hosts_wait_their_turn_and_a_launch_through_a_broker_restart_starts_once(cluster):
    # One cluster for both: each takes seconds of training, and a cluster about as long to build.
    runs_span_namespace_hosts_at_their_own_addresses_and_wait_their_turn(cluster)
    a_broker_restarted_while_a_launch_is_in_flight_starts_the_run_exactly_once(cluster)


def runs_span_namespace_hosts_at_their_own_addresses_and_wait_their_turn(cluster: Cluster) -> None:
    addresses = dict(Host.objects.values_list("name", "address"))
    # Each host found its address by the route to the control plane: its namespace's own.
    assert addresses == {"h0": cluster.network.address(0), "h1": cluster.network.address(1)}

    # A dp2 run of two nodes spans both hosts, one rank each, and matches the same run on one.
    spanning = submit(
        cluster, "two hosts", {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN}
    )
    assert spanning.status_code == 201, spanning.text
    spanning_run = wait_finished(spanning.json()["id"])
    assert spanning_run.status == "succeeded", spanning_run.status_reason
    placed = spanning_run.events.get(kind="placed").data["nodes"]
    assert sorted((n["host"], n["address"]) for n in placed) == sorted(addresses.items())
    # Its agents met at the store on the control plane's machine (the bridge), not on a host.
    assert spanning_run.rendezvous.split(":")[0] == cluster.network.bridge_address
    rendezvous = list(spanning_run.events.filter(kind="rendezvous").values_list("data", flat=True))
    assert sorted(r["node"] for r in rendezvous) == [0, 1] and {r["nodes"] for r in rendezvous} == {2}
    assert list(spanning_run.checkpoints.values_list("step", flat=True)) == [2, 4]

    single = wait_finished(submit(cluster, "one host", {"layout": {"dp": 2}, "train": TRAIN}).json()["id"])
    assert single.status == "succeeded", single.status_reason
    assert len(single.events.get(kind="placed").data["nodes"]) == 1
    assert len(losses(spanning_run.pk)) == 4
    assert losses(spanning_run.pk) == pytest.approx(losses(single.pk), rel=1e-6)

    # More devices than the cluster has: refused at submit, saying why.
    too_big = submit(
        cluster,
        "too big",
        {
            "layout": {"dp": 6},
            "nodes": {"min": 2, "max": 2, "nproc_per_node": 3},
            "train": {**TRAIN, "global_batch": 12},
        },
    )
    assert too_big.status_code == 400
    assert "the cluster has 2 CPU hosts with 4 CPU slots in all" in too_big.json()["spec"]["nodes"][0]

    # Three runs that each take the whole cluster run one after another, never two at once.
    whole = {"layout": {"dp": 4}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 2}, "train": TRAIN}
    ids = [submit(cluster, f"whole {i}", whole).json()["id"] for i in range(3)]
    wait_until(
        lambda: Run.objects.get(pk=ids[1]).status_reason.startswith("waiting: needs 4 CPU slots"), 120, "the reason"
    )
    finished = [wait_finished(run_id) for run_id in ids]
    assert [r.status for r in finished] == ["succeeded"] * 3
    placed_at = [r.events.get(kind="placed").time for r in finished]
    for before, after in zip(finished, placed_at[1:], strict=False):
        assert before.finished_at <= after
    # Their devices came back once the hosts' beats no longer listed their agents.
    wait_until(lambda: cluster.api.get("/api/hosts/").json()["results"][0]["free"] == 2, 30, "the slots back")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("lost_node", [1, 0], ids=["node1", "node0"])
def test_a_host_killed_mid_run_is_marked_lost_and_the_run_goes_on_on_the_other(cluster, lost_node):
    spec = {
        "layout": {"dp": 2},
        "nodes": {"min": 1, "max": 2, "nproc_per_node": 1},
        "train": {"steps": 30, "warmup_steps": 2, "checkpoint_interval": 5, "global_batch": 8},
    }
    run_id = submit(cluster, "survives", spec).json()["id"]
    wait_until(lambda: Run.objects.get(pk=run_id).step >= 7, 300, "the run to train on both hosts past a checkpoint")
    placed = {n["node"]: n["host"] for n in Run.objects.get(pk=run_id).events.get(kind="placed").data["nodes"]}
    victim, survivor = placed[lost_node], placed[1 - lost_node]
    namespace = cluster.network.namespaces[int(victim.removeprefix("h"))]
    # The host worker and the agent and rank it started go at once, as with a power cut. The
    # run's rendezvous store is on the control plane, whichever node's host this is.
    assert cluster.network.kill_everything_in(namespace) >= 3

    wait_until(lambda: Host.objects.get(name=victim).status == "lost", 30, f"{victim} to be marked lost")
    run = wait_finished(run_id)
    assert run.status == "succeeded", run.status_reason
    assert run.step == 30
    lost = run.events.get(kind="host_lost").data
    assert (lost["host"], lost["nodes"], lost["nodes_left"], lost["continues"]) == (
        victim, [f"node-{lost_node}"], 1, True
    )  # fmt: skip
    # The survivor's agent met again alone (before or after the control plane marked the host
    # lost) and the run went on there, never queued again.
    assert run.events.filter(kind="restarting").exists()
    assert 1 in {r["nodes"] for r in run.events.filter(kind="rendezvous").values_list("data", flat=True)}
    assert not run.events.filter(kind="queued", data__resume=True).exists()
    assert len(run.events.filter(kind="placed")) == 1
    # Every step has its loss, and a step trained twice (before the loss on two ranks, again
    # after the resume on one) the same one, up to float32's rounding: one rank sums the same
    # samples' gradients in another order.
    by_step: dict[int, set[float]] = {}
    for data in run.events.filter(kind="metrics").values_list("data", flat=True):
        by_step.setdefault(data["step"], set()).add(data["loss"])
    assert sorted(by_step) == list(range(1, 31))
    twice = {step: sorted(losses) for step, losses in by_step.items() if len(losses) > 1}
    assert all(high == pytest.approx(low, rel=1e-5) for low, high in twice.values()), twice
    hosts = {h["name"]: h for h in cluster.api.get("/api/hosts/").json()["results"]}
    assert hosts[victim]["status"] == "lost" and hosts[survivor]["status"] == "ready"


class ChatLoop(threading.Thread):
    """Chats through the control plane's /v1 one after another with the official client (its
    retries on, as a user's would be) until finished; keeps what each request came to."""

    def __init__(self, url: str, key: str, model: str) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120, max_retries=2)
        self.model = model
        self.answered = 0
        self.failures: list[str] = []
        self._finish = threading.Event()

    def run(self) -> None:
        while not self._finish.is_set():
            try:
                chat = self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "the cat"}], max_tokens=3
                )
                assert chat.choices[0].message.content is not None
                self.answered += 1
            except Exception as exc:  # every way a request fails is a finding
                self.failures.append(f"{type(exc).__name__}: {exc}")
            self._finish.wait(0.2)

    def finish(self) -> None:
        self._finish.set()
        self.join(timeout=180)


def supervisor_pid(cluster: Cluster, host: str, deployment_id: int) -> int | None:
    """The pid of the deployment's supervisor that `host`'s last beat lists, if any."""
    hosts = {h["name"]: h for h in cluster.api.get("/api/hosts/").json()["results"]}
    return next((p["pid"] for p in hosts[host]["running"] if p["key"] == f"deployment-{deployment_id}"), None)


def serving_processes(cluster: Cluster) -> list[str]:
    """The supervisors and vLLM replicas running in either namespace host."""
    found = []
    for namespace in cluster.network.namespaces:
        for pid, argv in cluster.network.commands_in(namespace).items():
            command = " ".join(argv)
            if "serving.supervisor" in command or "vllm" in command:
                found.append(f"{namespace} {pid}: {command[:120]}")
    return found


@pytest.fixture
def one_slot_cluster(network, alice, transactional_db, tmp_path, monkeypatch) -> Iterator[Cluster]:
    """The `cluster`, with one CPU slot (and core) a host: a replica lost with its host fits
    nowhere else."""
    monkeypatch.setenv("FATHOM_RECONCILE_INTERVAL", "2")  # re-placing waits for the next pass
    with running_cluster(network, alice, tmp_path, monkeypatch, cpu_slots=1, core_each=True) as running:
        yield running


@pytest.mark.vllm
@pytest.mark.django_db(transaction=True)
def test_a_deployment_on_two_namespace_hosts_serves_through_v1_across_the_loss_of_one_and_stops_on_both(
    one_slot_cluster,
):
    cluster = one_slot_cluster
    trained = submit(cluster, "servable", {"train": {"steps": 6, "warmup_steps": 2, "checkpoint_interval": 6}}).json()
    wait_until(
        lambda: (c := cluster.api.get(f"/api/runs/{trained['id']}/checkpoints/").json()) and c[-1]["export_path"],
        600, "the trained run's export",
    )  # fmt: skip
    checkpoint = cluster.api.get(f"/api/runs/{trained['id']}/checkpoints/").json()[-1]
    options = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}
    # Round robin: the same chat, sent one at a time, reaches both hosts' replicas (by prefix, the
    # default, it would stay on one).
    body = {
        "checkpoint": checkpoint["id"], "replicas": 2, "options": options, "served_model_name": "spread",
        "routing": "round_robin",
    }  # fmt: skip
    created = cluster.api.post("/api/deployments/", json=body)
    assert created.status_code == 201, created.text
    deployment_id = created.json()["id"]
    addresses = {cluster.network.address(0), cluster.network.address(1)}

    def deployment() -> dict:
        return cluster.api.get(f"/api/deployments/{deployment_id}/").json()

    def events() -> list[dict]:
        return cluster.api.get(f"/api/deployments/{deployment_id}/events/").json()

    try:
        wait_until(lambda: deployment()["status"] in ("ready", "failed"), 900, "two ready replicas")
        assert deployment()["status"] == "ready", deployment()
        placed = next(e["data"]["hosts"] for e in events() if e["kind"] == "placed")
        # One replica on each host (a lost host costs one replica, not both), each listening on its
        # host's own address, where the web process reaches it.
        assert sorted((p["host"], p["replicas"]) for p in placed) == [("h0", [0]), ("h1", [1])]
        by_replica = {p["replicas"][0]: p["address"] for p in placed}
        urls = {r["index"]: r["url"].split("//")[1].split(":")[0] for r in deployment()["replica_set"]}
        assert urls == by_replica and set(urls.values()) == addresses
        key = cluster.api.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "t"}).json()["key"]
        # Enough chats that the router, taking each replica in turn, uses both.
        for _ in range(4):
            chat = httpx.post(
                f"{cluster.url}/v1/chat/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                json={"model": "spread", "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 5},
            )  # fmt: skip
            assert chat.status_code == 200, chat.text
            assert chat.json()["choices"][0]["message"]["content"] is not None
        # Each replica answered some: its log (on its host, read through the API) shows the requests.
        for index in (0, 1):
            log = cluster.api.get(f"/api/deployments/{deployment_id}/logs/", params={"replica": index, "lines": 400})
            assert any("POST /v1/chat/completions" in line for line in log.json()["lines"]), index
        for host in cluster.api.get("/api/hosts/").json()["results"]:
            assert [c["node"] for c in host["claims"] if c["deployment"] == deployment_id] == (
                [0] if host["name"] == "h0" else [1]
            )
            assert f"deployment-{deployment_id}" in {p["key"] for p in host["running"]}

        # h0's host worker dies; the supervisor and replica it started run on (a crashed worker,
        # or a host cut off from the control plane). /v1 is used all along.
        orphan = supervisor_pid(cluster, "h0", deployment_id)
        assert orphan is not None
        orphan_gone_at: list[float] = []

        def watch_orphan() -> None:
            while is_alive(orphan):
                time.sleep(0.05)
            orphan_gone_at.append(time.time())

        threading.Thread(target=watch_orphan, daemon=True).start()
        chats = ChatLoop(cluster.url, key, "spread")
        chats.start()
        cluster.hosts[0].kill()
        wait_until(lambda: deployment()["status"] == "degraded", 60, "the deployment to go degraded")
        now = deployment()
        assert now["status_reason"] == "host h0 was lost with replica 0", now
        assert {r["index"]: r["status"] for r in now["replica_set"]} == {0: "dead", 1: "ready"}
        # Replica 0 fits on no other host (h1's one slot is replica 1's): it waits for h0.
        time.sleep(5)
        assert deployment()["status"] == "degraded" and is_alive(orphan)

        # h0 comes back running the orphaned supervisor, which no claim covers: it is stopped
        # before replica 0 is placed there again, and the device goes to the new one only then.
        cluster.hosts[0].start()
        wait_until(lambda: deployment()["status"] == "ready", 600, "replica 0 placed again on h0 and ready")
        chats.finish()
        assert chats.answered >= 10 and chats.failures == [], (chats.answered, chats.failures)
        again = [e for e in events() if e["kind"] == "placed" and e["data"].get("again")]
        assert [(e["data"]["again"], [p["host"] for p in e["data"]["hosts"]]) for e in again] == [([0], ["h0"])]
        assert orphan_gone_at, "the orphaned supervisor still runs"
        assert orphan_gone_at[0] <= datetime.fromisoformat(again[0]["time"]).timestamp()
        assert supervisor_pid(cluster, "h0", deployment_id) not in (None, orphan)
    finally:
        cluster.api.post(f"/api/deployments/{deployment_id}/stop/")
        wait_until(lambda: deployment()["status"] == "stopped", 180, "the stop")
    assert [r["status"] for r in deployment()["replica_set"]] == ["stopped", "stopped"]
    # Each host stopped its supervisor, and both hosts' slots are free again.
    wait_until(
        lambda: all(
            not h["claims"] and f"deployment-{deployment_id}" not in {p["key"] for p in h["running"]}
            for h in cluster.api.get("/api/hosts/").json()["results"]
        ),
        60, "both hosts to report their supervisor gone",
    )  # fmt: skip
    wait_until(lambda: not serving_processes(cluster), 30, "no supervisor or replica left on either host")


def a_broker_restarted_while_a_launch_is_in_flight_starts_the_run_exactly_once(cluster: Cluster) -> None:
    spec = {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN}
    run_id = submit(cluster, "through a restart", spec).json()["id"]
    # The launch task, or the start tasks it sends to the hosts, are in the broker now: a restart
    # loses them (it keeps nothing on disk). Placement runs from beat too, and a run that was
    # placed but never started is launched again by the reconcile task.
    cluster.broker.restart()
    run = wait_finished(run_id, timeout=900)
    assert run.status == "succeeded", run.status_reason
    started = sorted(run.events.filter(kind="agent_started").values_list("data__node", flat=True))
    assert started == [0, 1]
    assert list(run.events.filter(kind="metrics").values_list("data__step", flat=True)) == [1, 2, 3, 4]
    assert run.events.filter(kind="placed").count() == 1


@pytest.mark.django_db(transaction=True)
def test_a_start_task_the_broker_lost_for_one_host_is_sent_again_and_the_run_starts_once(
    network, alice, tmp_path, monkeypatch
):
    # Host h1's worker is down while the run is placed (not yet lost: it was seen a moment ago),
    # so its start task waits in the broker; h0 starts node 0's agent, which waits at the
    # rendezvous. Then the broker restarts and keeps nothing: h1 comes back to an empty queue.
    with running_cluster(network, alice, tmp_path, monkeypatch, host_lost_after=120) as cluster:
        cluster.hosts[1].stop()
        spec = {"layout": {"dp": 2}, "nodes": {"min": 2, "max": 2, "nproc_per_node": 1}, "train": TRAIN}
        run_id = submit(cluster, "half started", spec).json()["id"]

        def node0_runs() -> bool:
            return any(item["key"] == f"run-{run_id}-node-0" for item in Host.objects.get(name="h0").running)

        wait_until(node0_runs, 120, "node 0's agent on h0")
        cluster.broker.restart()
        cluster.hosts[1].start()
        run = wait_finished(run_id, timeout=300)
        assert run.status == "succeeded", run.status_reason
        started = sorted(run.events.filter(kind="agent_started").values_list("data__node", flat=True))
        assert started == [0, 1]  # node 0's agent once: the same launch sent again started nothing there
        assert list(run.events.filter(kind="metrics").values_list("data__step", flat=True)) == [1, 2, 3, 4]
        assert run.events.filter(kind="placed").count() == 1 and run.launch_attempts == 1
