"""What losing a host costs a run and a deployment, on two namespace hosts with two CPU slots each
on a core of their own (bench/netns_cluster.py), on PostgreSQL, with the product's defaults (a host is lost after 15 s
without a beat; host workers beat every 2 s; reconcile every 15 s).

    python -m bench.host_loss            # ends with one key=value line

1. Baseline: a dp2 run over both hosts (one rank each, `nodes.min=1`), untouched.
2. The same run again; past its second checkpoint, node 0's host loses power: SIGKILL to
   everything in its namespace (host worker, agent, rank; the run's rendezvous store is on the
   control plane). Measured: the loss to the first step trained after it (`node0_lost_resume_s`,
   that step's metrics event; target ≤ 20 s), whether the run resumed on the host left and
   succeeded (`node0_lost_resumed`: a `resumed` event after the loss), and the largest
   difference between a step's loss and the untouched run's (`loss_max_diff`). Then the host's
   worker starts again (the machine is back).
3. A deployment of the baseline's export, one replica on each host. A client, the official
   `openai` one with its retries on, chats through the control plane's /v1 one request after
   another while host h1 loses power, and on until the deployment is ready again (its lost
   replica placed again where there is room); `deployment_lost_host_ok_pct` is the share of
   requests answered (target ≥ 99). The deployment is stopped and both hosts' workers run on.

All along, every 0.2 s, `double_placed` counts the moments two live processes of different work
(run agents, replica supervisors: each its own session) hold one CPU slot of a host (their
`FATHOM_CPU_SLOTS`); at the end, `orphans` counts what still runs on either host besides its host
worker (agents, ranks, stores, supervisors, replicas) once every run and deployment has ended.
Targets: both 0.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx

from bench.netns_cluster import NetnsCluster, control_plane_on_postgres, netns_cluster
from bench.waiting import wait

DATABASE = "fathom_bench_host_loss"
RUN_SPEC = {
    "layout": {"dp": 2},
    "nodes": {"min": 1, "max": 2, "nproc_per_node": 1},
    "train": {"steps": 60, "warmup_steps": 2, "checkpoint_interval": 5, "global_batch": 8},
}
LOSS_AFTER_STEP = 11  # past the second checkpoint
REPLICA_OPTIONS = {"dtype": "float32", "enforce_eager": True, "max_model_len": 64, "max_num_seqs": 4, "kv_cache_gib": 1}


def cpu_slots_of(pid: int) -> set[str]:
    with contextlib.suppress(OSError):
        for entry in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0"):
            if entry.startswith("FATHOM_CPU_SLOTS="):
                return {slot for slot in entry.split("=", 1)[1].split(",") if slot}
    return set()


class SlotWatch(threading.Thread):
    """Counts the samples in which two sessions of work processes share a CPU slot of a host."""

    WORK = ("training.agent", "serving.supervisor")

    def __init__(self, cluster: NetnsCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.double_placed = 0
        self.seen: list[str] = []
        self._finish = threading.Event()

    def run(self) -> None:
        while not self._finish.wait(0.2):
            for namespace in list(self.cluster.namespaces):
                holders: dict[str, int] = {}
                for pid, argv in self.cluster.network.commands_in(namespace).items():  # type: ignore[attr-defined]
                    if not any(module in argv for module in self.WORK):
                        continue
                    with contextlib.suppress(OSError):
                        session = os.getsid(pid)
                        for slot in cpu_slots_of(pid):
                            if holders.setdefault(slot, session) != session:
                                self.double_placed += 1
                                self.seen.append(f"{namespace} slot {slot}: sessions {holders[slot]} and {session}")

    def finish(self) -> None:
        self._finish.set()
        self.join(timeout=10)


class Chats(threading.Thread):
    """One chat after another through /v1 with the official client, until finished."""

    def __init__(self, url: str, key: str, model: str) -> None:
        import openai

        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, timeout=120)  # retries: the default 2
        self.model = model
        self.sent = self.answered = 0
        self.errors: list[str] = []
        self._finish = threading.Event()

    def run(self) -> None:
        while not self._finish.is_set():
            self.sent += 1
            try:
                self.client.chat.completions.create(
                    model=self.model, messages=[{"role": "user", "content": "the cat"}], max_tokens=3
                )
                self.answered += 1
            except Exception as exc:  # each failed request is what this counts
                self.errors.append(f"{type(exc).__name__}: {exc}")
            self._finish.wait(0.1)

    def finish(self) -> None:
        self._finish.set()
        self.join(timeout=180)


def losses(run_id: int) -> dict[int, float]:
    from runs.models import RunEvent

    events = RunEvent.objects.filter(run_id=run_id, kind="metrics").order_by("seq").values_list("data", flat=True)
    return {data["step"]: data["loss"] for data in events}  # a replayed step: as last reported


def finished(run_id: int, timeout: float) -> str:
    from runs.models import Run

    wait(lambda: Run.objects.get(pk=run_id).status in Run.FINISHED, timeout, f"run {run_id} to end")
    return Run.objects.get(pk=run_id).status


def run_losing_node0_host(cluster: NetnsCluster, submit: Callable[[str], int]) -> tuple[int, float, bool]:
    """The run whose node 0's host loses power; returns (run, loss to first step after it, resumed)."""
    from hosts.models import Host
    from runs.models import Run, RunEvent

    run_id = submit("loses node 0's host")
    wait(lambda: Run.objects.get(pk=run_id).step >= LOSS_AFTER_STEP, 300, "the run past its second checkpoint")
    placed = RunEvent.objects.filter(run_id=run_id, kind="placed").first()
    assert placed is not None
    victim = int(next(n["host"] for n in placed.data["nodes"] if n["node"] == 0).removeprefix("h"))
    lost_at = time.time()
    killed = cluster.power_cut(victim)
    print(f"power cut on h{victim} (node 0's host) at step {Run.objects.get(pk=run_id).step}: {killed} processes")
    first = wait(
        lambda: RunEvent.objects.filter(run_id=run_id, kind="metrics", time__gt=_aware(lost_at)).order_by("time").first(),
        600, "the first step after the loss",
    )  # fmt: skip
    resume_s = first.time.timestamp() - lost_at
    # Where those seconds went: each step of the way back, from the run's own events.
    kinds = ("failed", "status", "host_lost", "queued", "placed", "agent_started", "rendezvous", "resumed")
    after = RunEvent.objects.filter(run_id=run_id, kind__in=kinds, time__gt=_aware(lost_at)).order_by("time")
    for event in after:
        said = event.data.get("reason") or event.data.get("status") or event.data.get("host") or ""
        print(f"  +{event.time.timestamp() - lost_at:5.1f} s {event.kind} {said}")
    status = finished(run_id, 600)
    resumed = status == "succeeded" and after.filter(kind="resumed").exists()
    print(f"first step after the loss: step {first.data['step']} at +{resume_s:.1f} s; the run {status}")
    # The machine is back: the deployment that follows needs both hosts ready to spread over
    # them (seen: created while h0 was still rejoining, both replicas went to h1).
    cluster.start_host(victim, cpu_slots=2, core=victim)
    wait(lambda: Host.objects.get(name=f"h{victim}").status == "ready", 120, f"h{victim} back")
    return run_id, resume_s, resumed


def _aware(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=UTC)


def deployment_losing_a_host(cluster: NetnsCluster, api: httpx.Client, checkpoint_id: int) -> Chats:
    """Two replicas, one per host; h1 loses power under a chat loop; returns the loop's counts."""
    from hosts.models import Host

    body = {"checkpoint": checkpoint_id, "replicas": 2, "options": REPLICA_OPTIONS, "served_model_name": "bench"}
    deployment_id = api.post("/api/deployments/", json=body).json()["id"]

    def status() -> str:
        return api.get(f"/api/deployments/{deployment_id}/").json()["status"]

    wait(lambda: status() in ("ready", "failed"), 900, "two ready replicas")
    assert status() == "ready", api.get(f"/api/deployments/{deployment_id}/").json()
    events = api.get(f"/api/deployments/{deployment_id}/events/").json()
    placed = next(e["data"]["hosts"] for e in events if e["kind"] == "placed")
    # Losing h1 must cost one replica, not both.
    assert sorted(p["host"] for p in placed) == ["h0", "h1"], f"replicas not spread over both hosts: {placed}"
    key = api.post(f"/api/deployments/{deployment_id}/keys/", json={"name": "bench"}).json()["key"]
    chats = Chats(cluster.url, key, "bench")
    chats.start()
    time.sleep(5)
    killed = cluster.power_cut(1)
    print(f"power cut on h1 under the deployment: {killed} processes")
    wait(lambda: status() == "degraded", 120, "the deployment to go degraded")
    cluster.start_host(1, cpu_slots=2, core=1)
    wait(lambda: Host.objects.get(name="h1").status == "ready", 120, "h1 back")
    wait(lambda: status() == "ready", 600, "the lost replica placed again and ready")
    time.sleep(5)
    chats.finish()
    api.post(f"/api/deployments/{deployment_id}/stop/")
    wait(lambda: status() == "stopped", 300, "the deployment to stop")
    return chats


def leftovers(cluster: NetnsCluster) -> list[str]:
    """What runs on either host besides its host worker."""
    found = []
    for namespace in cluster.namespaces:
        for pid, argv in cluster.network.commands_in(namespace).items():  # type: ignore[attr-defined]
            if argv and "hostworker" not in argv:
                found.append(f"{namespace} {pid}: {' '.join(argv)[:100]}")
    return found


def main() -> None:
    data_dir = control_plane_on_postgres(DATABASE, "fathom-bench-host-loss-")
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create(username="bench")
    token = Token.objects.create(user=user).key
    with netns_cluster(os.environ["DATABASE_URL"], data_dir, core_each=True) as cluster:
        api = httpx.Client(base_url=cluster.url, headers={"Authorization": f"Token {token}"}, timeout=60)

        def submit(name: str) -> int:
            return int(api.post("/api/runs/", json={"name": name, "spec": RUN_SPEC}).json()["id"])

        slots = SlotWatch(cluster)
        slots.start()
        started = time.time()
        baseline = submit("untouched")
        print(f"untouched run: {finished(baseline, 600)} in {time.time() - started:.1f} s")
        started = time.time()
        lost_run, resume_s, resumed = run_losing_node0_host(cluster, submit)
        print(f"run that lost node 0's host: {time.time() - started:.1f} s")
        before, after = losses(baseline), losses(lost_run)
        diff = max(abs(before[step] - after.get(step, float("inf"))) for step in before)
        checkpoint = wait(
            lambda: (c := api.get(f"/api/runs/{baseline}/checkpoints/").json()) and c[-1]["export_path"] and c[-1],
            600, "the untouched run's export",
        )  # fmt: skip
        chats = deployment_losing_a_host(cluster, api, checkpoint["id"])
        ok_pct = 100.0 * chats.answered / max(chats.sent, 1)
        print(f"/v1 across the loss: {chats.answered} of {chats.sent} answered; errors: {chats.errors[:3]}")
        try:
            wait(lambda: not leftovers(cluster), 60, "nothing left running on the hosts")
        except TimeoutError:
            pass
        orphans = leftovers(cluster)
        slots.finish()
        for line in orphans + slots.seen[:5]:
            print(line)
    print(
        f"clock=wall node0_lost_resume_s={resume_s:.1f} node0_lost_resumed={int(resumed)} "
        f"loss_max_diff={diff:.2e} deployment_lost_host_ok_pct={ok_pct:.1f} orphans={len(orphans)} "
        f"double_placed={slots.double_placed}"
    )


if __name__ == "__main__":
    main()
