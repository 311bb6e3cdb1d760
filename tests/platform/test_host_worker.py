"""A real host worker (`python -m hostworker`) joins a real web process with the join token,
heartbeats, and runs the node agents of the runs placed on it; the Celery worker only places
and sends. Everything over loopback here; tests/platform/test_hosts_netns.py puts hosts in
network namespaces of their own."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from hosts.models import Host, Quota
from hostworker.config import HostConfig
from hostworker.devices import slot_cores
from hostworker.processes import Processes, is_alive
from runs.models import Run
from tests.platform.conftest import HostWorker, free_port
from tests.platform.test_run_lifecycle import api, wait_until
from tools.check_parity import launch, step_values
from training.config import RunSpec
from training.heartbeat import read_beat
from training.run_dir import RunDir


def allowed_cores(pid: int) -> list[int]:
    """The cores process `pid` may run on, as the kernel reports them."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            cores: list[int] = []
            for part in line.split(":")[1].strip().split(","):
                first, _, last = part.partition("-")
                cores += range(int(first), int(last or first) + 1)
            return cores
    raise AssertionError(f"no Cpus_allowed_list for {pid}")


def test_cpu_slots_share_a_hosts_cores_equally_and_cycle_when_there_are_more_slots() -> None:
    assert slot_cores([0, 1], 2, [0, 1]) == [[0], [1]]
    assert slot_cores([1, 3], 4, [0, 1, 2, 3, 4, 5, 6, 7]) == [[2, 3], [6, 7]]
    assert slot_cores([1], 2, [4, 5, 6, 7]) == [[6, 7]]  # the worker's own cores, whatever their ids
    assert slot_cores([2, 3], 4, [0, 1]) == [[0], [1]]

def host_processes(tmp_path: Path) -> Processes:
    """The process table of a host worker with its data and state under `tmp_path`."""
    config = HostConfig(
        name="h", control_url="http://127.0.0.1:9", join_token="t", address="127.0.0.1", broker_url="filesystem://",
        data_dir=tmp_path / "host-data", state_dir=tmp_path / "state", labels={}, cpu_slots=1, heartbeat_s=1.0,
        python=sys.executable,
    )  # fmt: skip
    return Processes(config)


def test_ranks_bind_gloo_and_nccl_to_the_interface_the_host_registered_with(tmp_path: Path, monkeypatch) -> None:
    shown = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    addresses = {line.split()[1]: line.split()[3].split("/")[0] for line in shown.splitlines()}
    interface, address = next((i, a) for i, a in addresses.items() if not a.startswith("127."))
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    processes = Processes(dataclasses.replace(host_processes(tmp_path).config, address=address))
    env = processes.environment([0], "gpu")
    assert (env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"], env["CUDA_VISIBLE_DEVICES"]) == (interface, interface, "0")
    assert env["FATHOM_HOST_NAME"] == "h"  # an agent names its host as Fathom knows it, not by the machine's hostname
    assert "NCCL_SOCKET_IFNAME" not in host_processes(tmp_path).environment([0], "cpu")  # loopback: left to NCCL
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")  # the operator's
    assert processes.environment([0], "gpu")["NCCL_SOCKET_IFNAME"] == "ib0"


def test_a_host_keeps_a_runs_folder_under_its_own_data_folder_with_the_files_it_was_sent(tmp_path: Path) -> None:
    processes = host_processes(tmp_path)
    store = "training.agent.rendezvous_store"
    with pytest.raises(ValueError, match="folder must be a relative path inside"):
        processes.start("run-1-store", store, [], "{folder}/store.log", folder="../elsewhere")
    with pytest.raises(ValueError, match="a file's name must be a relative path inside"):
        processes.start("run-1-store", store, [], "{folder}/store.log", folder="runs/1-x", files={"../../spec.json": "{}"})
    assert processes.running() == []

    args = ["--endpoint", f"127.0.0.1:{free_port()}", "--run-dir", "{folder}", "--start-grace-s", "1"]
    pid = processes.start("run-1-store", store, args, "{folder}/logs/store.log", folder="runs/1-x", files={"spec.json": '{"a": 1}'})
    assert pid is not None
    own = tmp_path / "host-data" / "runs" / "1-x"
    assert (own / "spec.json").read_text() == '{"a": 1}'
    # The store watched this folder's agent locks (none) and left: it was given the folder itself.
    wait_until(lambda: not is_alive(pid), 120, "the store to leave")
    assert "no agent of the run is left" in (own / "logs" / "store.log").read_text()


def test_a_start_delivered_twice_for_the_same_launch_starts_one_process(tmp_path: Path) -> None:
    # The control plane sends a launch's start tasks again when a host lacks one of them (a broker
    # that lost it); the hosts that did get them must not start a second store or agent.
    processes = host_processes(tmp_path)
    store = "training.agent.rendezvous_store"
    args = ["--endpoint", f"127.0.0.1:{free_port()}", "--run-dir", "{folder}", "--start-grace-s", "60"]
    first = processes.start("run-1-store", store, args, "{folder}/store.log", launch=1, folder="runs/1-x")
    try:
        assert first is not None
        assert processes.start("run-1-store", store, args, "{folder}/store.log", launch=1, folder="runs/1-x") is None
        assert processes.running() == [{"key": "run-1-store", "pid": first, "launch": 1}]
    finally:
        processes.stop("run-1-store", signal.SIGKILL)
    wait_until(lambda: processes.running() == [], 30, "the store to be gone")


pytestmark = pytest.mark.slow

TOKEN = "test-join-token"


@pytest.fixture
def join_token(monkeypatch):
    # Before live_web: the web process takes it from the environment.
    monkeypatch.setenv("FATHOM_JOIN_TOKEN", TOKEN)
    return TOKEN


@pytest.mark.django_db(transaction=True)
def test_a_host_worker_without_the_join_token_is_turned_away(join_token, live_web, tmp_path):
    wrong = HostWorker("h1", tmp_path / "wrong.log", live_web.url, "not-the-token")
    assert wrong.start().wait(timeout=120) == 2
    assert "refused host h1" in wrong.log.read_text()
    assert "host heartbeat from 127.0.0.1 for host h1 refused: neither its secret nor the join token" in live_web.log.read_text()
    missing = HostWorker("h1", tmp_path / "missing.log", live_web.url, "")
    assert missing.start().wait(timeout=120) == 2
    assert "FATHOM_JOIN_TOKEN is not set" in missing.log.read_text()
    assert not Host.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_run_placed_on_a_host_worker_trains_there_is_cancelled_there_and_frees_its_slots(
    alice, join_token, live_web, celery_worker, tmp_path
):
    host = HostWorker("local", tmp_path / "host.log", live_web.url, TOKEN, cpu_slots=2)
    host.start()
    try:
        client = api(live_web, alice)
        wait_until(lambda: client.get("/api/hosts/").json()["count"] == 1, 120, "the host to join")
        listed = client.get("/api/hosts/").json()["results"][0]
        assert (listed["name"], listed["kind"], listed["free"], listed["status"]) == ("local", "cpu", 2, "ready")
        # It joined with the join token and keeps the secret it was given, for its owner's eyes only.
        kept = Path(settings.DATA_DIR) / "hosts" / "local" / "host_secret"
        # The worker writes it once the join's answer arrives: a moment after the join is listed
        # (seen under a loaded clean-clone run, 2026-12-07).
        wait_until(kept.exists, 30, "the host to keep its secret")
        assert Host.objects.get().secret_sha256 == hashlib.sha256(kept.read_bytes()).hexdigest()
        assert kept.stat().st_mode & 0o777 == 0o600
        # Its CPU's flags, as this machine's /proc/cpuinfo lists them: placement reads them.
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
        assert Host.objects.get().cpu_flags == sorted(flags.split(":", 1)[1].split())

        spec = {"layout": {"dp": 2}, "train": {"steps": 6, "warmup_steps": 2, "checkpoint_interval": 3}}
        run_id = client.post("/api/runs/", json={"name": "on a host", "spec": spec}).json()["id"]
        key = f"run-{run_id}-node-0"
        wait_until(lambda: key in {p["key"] for p in Host.objects.get().running}, 180, "the host to report the agent")
        wait_until(lambda: Run.objects.get(pk=run_id).status == "succeeded", 300, "the run to succeed")
        run = Run.objects.get(pk=run_id)
        assert run.events.get(kind="placed").data["nodes"] == [
            {"node": 0, "host": "local", "address": "127.0.0.1", "devices": [0, 1]}
        ]
        assert list(run.events.filter(kind="metrics").values_list("data__step", flat=True)) == [1, 2, 3, 4, 5, 6]
        wait_until(lambda: client.get("/api/hosts/").json()["results"][0]["free"] == 2, 30, "the slots to be free")
        assert f"started {key}: training.agent" in host.log.read_text()

        # A cancel travels to the host's queue; the agent stops its ranks there.
        long = {"train": {"steps": 400, "warmup_steps": 2, "checkpoint_interval": 50}}
        long_id = client.post("/api/runs/", json={"name": "long", "spec": long}).json()["id"]
        wait_until(lambda: Run.objects.get(pk=long_id).step >= 1, 240, "the long run to train")
        # Its one rank holds slot 0, and runs on slot 0's core only (this host: 2 slots, one core
        # each on a 2-core machine; unpinned, it could use both).
        beat = read_beat(RunDir(Run.objects.get(pk=long_id).folder).node(0).heartbeat_file(0))
        assert beat is not None
        assert allowed_cores(beat.pid) == slot_cores([0], 2, sorted(os.sched_getaffinity(0)))[0]
        assert client.post(f"/api/runs/{long_id}/cancel/").status_code == 200
        wait_until(lambda: Run.objects.get(pk=long_id).status == "cancelled", 120, "the cancel")
        # The cancel is the host's stop task (SIGTERM to the agent): no marker is written.
        key = f"run-{long_id}-node-0"
        wait_until(lambda: f"stopped {key} (pid" in host.log.read_text(), 60, "the host to take the stop task")
        assert not RunDir(Run.objects.get(pk=long_id).folder).cancel_marker.exists()
        # This host shares our data folder (one machine): its agent found that out and shipped
        # no log; the log API reads the ranks' own files.
        assert not RunDir(Run.objects.get(pk=long_id).folder).shipped_logs_file.exists()
        assert client.get(f"/api/runs/{long_id}/logs/", params={"rank": 0}).json()["lines"]
        wait_until(lambda: Host.objects.get().running == [], 60, "the host to report nothing running")
        # The slots come back once the host's beat says the agent is gone (a pass it queues).
        wait_until(lambda: client.get("/api/hosts/").json()["results"][0]["free"] == 2, 30, "the slots back")
        preempted_and_resumed_on_the_same_curve(client, alice, tmp_path)
    finally:
        host.stop()


def preempted_and_resumed_on_the_same_curve(client, alice, tmp_path: Path) -> None:
    """A run of higher priority that cannot start makes a lower one checkpoint the step its ranks
    agree on and go back to the queue; the high one runs, then the low one resumes from that
    step on the loss curve of a run nobody stopped, bit for bit (issue 36)."""
    steps = 30  # rank 0 waits 0.2 s a step: the high run arrives mid-run however fast this host is
    low_spec = {
        "layout": {"dp": 2}, "train": {"steps": steps, "checkpoint_interval": steps, "global_batch": 4},
        "faults": [{"kind": "slow_steps", "rank": 0, "step": 1}],
    }  # fmt: skip
    low = client.post("/api/runs/", json={"name": "low", "spec": low_spec}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=low).step >= 3, 240, "the low run to train")
    Quota.objects.create(user=alice, priority_ceiling=5)
    high_spec = {"layout": {"dp": 2}, "train": {"steps": 4, "warmup_steps": 2}}
    high = client.post("/api/runs/", json={"name": "high", "spec": high_spec, "priority": 5}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=high).status in Run.FINISHED, 300, "the high run to end")
    wait_until(lambda: Run.objects.get(pk=low).status in Run.FINISHED, 300, "the low run to end")
    assert Run.objects.get(pk=high).status == "succeeded"
    run = Run.objects.get(pk=low)
    assert run.status == "succeeded", run.status_reason
    events = list(run.events.order_by("seq").values("kind", "time", "data"))
    kinds = [e["kind"] for e in events]
    asked = next(e for e in events if e["kind"] == "preempt_requested")
    assert asked["data"]["by"] == high
    (stop,) = [e["data"]["step"] for e in events if e["kind"] == "stop_requested"]
    assert 3 <= stop < steps
    assert [e["data"]["step"] for e in events if e["kind"] == "checkpoint"] == [stop, steps]
    assert next(e for e in events if e["kind"] == "preempted")["data"] == {
        "by": high, "step": stop, "reason": f"preempted by run {high}; resumes from step {stop}",
    }  # fmt: skip
    assert kinds.index("stopped") < kinds.index("preempted") < kinds.index("resumed")
    assert [e["data"]["step"] for e in events if e["kind"] == "resumed"] == [stop]
    # The high run's first step came after the low one stopped, and before it resumed.
    high_first = Run.objects.get(pk=high).events.filter(kind="metrics").order_by("seq").first()
    assert next(e["time"] for e in events if e["kind"] == "stopped") < high_first.time
    assert high_first.time < next(e["time"] for e in events if e["kind"] == "resumed")
    # Every step once, on the curve of the same spec run without a stop (nor the wait, which
    # changes no value).
    losses = [(e["data"]["step"], e["data"]["loss"]) for e in events if e["kind"] == "metrics"]
    assert [step for step, _ in losses] == list(range(1, steps + 1))
    reference = launch(dataclasses.replace(RunSpec.from_json(run.run_dir.spec_file.read_text()), faults=[]),
                       tmp_path / "uninterrupted", 600)  # fmt: skip
    assert dict(losses) == step_values(reference)
