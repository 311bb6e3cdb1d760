"""Prepares a run's folder and starts its node agents: as detached local processes, or, once
hosts registered, as tasks on the queues of the hosts the scheduler placed the run on.

Agents outlive the Celery task that starts them: the task returns as soon as they run. Each
agent is started under `flock -n` on a per-node lock file, so a launch delivered twice (a
worker killed after it claimed the run) can never start a second agent for the same node. A run
of several nodes also gets its rendezvous store as a process of its own
(training/agent/rendezvous_store.py), so that losing node 0's agent does not end the job: on this
machine, the control plane's, for a run on hosts, so that losing any of its hosts does not either.
"""

from __future__ import annotations

import hmac
import json
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from django.utils.crypto import salted_hmac

from controlplane.celery import app
from controlplane.processes import flock_held, is_alive, start_detached
from hosts.models import DeviceClaim, Host, running_keys
from runs.models import Run
from training.ports import listen_port
from training.run_dir import RunDir


@dataclass(frozen=True)
class Launch:
    """One launch of a run: its folder and its number (the run's `launch_attempts` when it was
    prepared; host workers tag what they run with it, and its agents' tokens derive from it)."""

    run_id: int
    folder: Path
    number: int

    def token(self, node: int) -> str:
        return node_token(self.run_id, self.number, node)


def prepare(run: Run) -> Launch:
    """Writes the run's spec file and makes the current launch's node tokens the ones accepted;
    returns the launch, its number read once so that the tokens and the hosts' tag always agree.

    The spec is written as it was stored at submit, resolved and checked (data paths included,
    filled in from the objects the run names): nothing here parses or changes it.
    """
    folder = run.run_dir
    folder.logs_dir.mkdir(parents=True, exist_ok=True)
    # A resumed run starts in the folder its cancel (or its preemption) was asked in: spent.
    folder.cancel_marker.unlink(missing_ok=True)
    folder.stop_request.unlink(missing_ok=True)
    tmp = folder.spec_file.with_name(folder.spec_file.name + ".tmp")
    tmp.write_text(spec_text(run))
    tmp.replace(folder.spec_file)
    number = Run.objects.values_list("launch_attempts", flat=True).get(pk=run.pk)
    Run.objects.filter(pk=run.pk).update(token_launch=number)
    return Launch(run.pk, folder.path, number)


def node_token(run_id: int, launch: int, node: int) -> str:
    """The token of node `node`'s agent in one launch of a run: derived from the server's
    secret, not stored, so that a launch's start tasks can be sent again (a broker that lost
    one) with the tokens the agents already started hold. It speaks for its node only (the
    events and logs it sends name their node), so a host holds no token of another host's
    nodes. A new launch has new tokens, which lock out the last one's."""
    return salted_hmac("fathom.runs.node-token", f"{run_id}:{launch}:{node}", algorithm="sha256").hexdigest()


def is_node_token(run: Run, node: int, token: str) -> bool:
    """Whether `token` is node `node`'s in the run's current launch."""
    if run.token_launch is None or not token:
        return False
    return hmac.compare_digest(token, node_token(run.pk, run.token_launch, node))


def spec_text(run: Run) -> str:
    return json.dumps(run.spec, indent=2, sort_keys=True)  # as RunSpec.to_json writes it


def start_agents(run: Run, launch: Launch) -> list[int]:
    folder = launch.folder
    run_dir = RunDir(folder)
    rdzv = f"127.0.0.1:{listen_port(settings.RENDEZVOUS_PORTS)}"
    store_args: list[str] = []
    if run.node_count > 1:
        # It leaves by itself once no agent of the run holds its lock; the agents only connect.
        start_detached(
            [settings.TRAINING_PYTHON, "-m", "training.agent.rendezvous_store", "--endpoint", rdzv, "--run-dir", str(folder)],
            run_dir.rendezvous_store_log,
        )
        store_args = ["--host-store", "no"]
    pids = []
    for node in range(run.node_count):
        command = [
            "flock", "-n", "-E", "75", str(run_dir.agent_lock(node)),
            settings.TRAINING_PYTHON, "-m", "training.agent",
            *agent_arguments(run, folder, node, rdzv, launch.token(node)), *store_args,
        ]  # fmt: skip
        pids.append(start_detached(command, run_dir.agent_log(node)))
    return pids


def start_on_hosts(run: Run) -> None:
    """Starts the placed run: its rendezvous store (several nodes) here, at the endpoint chosen
    at placement, then one agent per node by a start task to its host's queue, each told its
    host's address and its devices. The host worker starts them under the agent lock, so a start
    delivered twice starts one agent."""
    launch = prepare(run)
    # Each host keeps the run's folder under its own data folder (the host worker puts it where
    # HOST_FOLDER stands), and gets the spec with the start: a host needs nothing of ours.
    run_dir = RunDir(Path(HOST_FOLDER))
    on_host = {"folder": str(run.folder.relative_to(settings.DATA_DIR)), "launch": launch.number}
    claims = list(DeviceClaim.objects.filter(run=run).select_related("host").order_by("node", "device"))
    nodes: dict[int, tuple[Host, list[int]]] = {}
    for claim in claims:
        nodes.setdefault(claim.node, (claim.host, []))[1].append(claim.device)
    store_args: list[str] = []
    if len(nodes) > 1:
        start_store_here(run, launch.number)
        store_args = ["--host-store", "no"]
    for node, (host, devices) in sorted(nodes.items()):
        send_to_host(host, "start_process", {
            "key": agent_key(run.pk, node), "module": "training.agent", "lock": str(run_dir.agent_lock(node)),
            "args": [
                *agent_arguments(run, run_dir.path, node, run.rendezvous, launch.token(node)),
                "--local-addr", host.address,
                "--logs-url", f"{settings.PUBLIC_URL}/api/runs/{run.pk}/shipped-logs/", *store_args,
            ],
            "log": str(run_dir.agent_log(node)), "devices": devices, "device_kind": host.device_kind,
            "files": {run_dir.spec_file.name: spec_text(run)}, **on_host,
        })  # fmt: skip


def start_store_here(run: Run, launch: int) -> None:
    """The rendezvous store of a run on several hosts, on this machine at the run's endpoint
    (`settings.RENDEZVOUS_ADDRESS`): none of the run's hosts holds it, so the agents that a lost
    host leaves meet at it again. It leaves once no agent keeps the rendezvous alive. Under flock
    on the launch's lock: a launch started twice starts one store."""
    run_dir = run.run_dir
    command = [
        "flock", "-n", "-E", "75", str(run_dir.rendezvous_store_lock(launch)),
        settings.TRAINING_PYTHON, "-m", "training.agent.rendezvous_store",
        "--endpoint", run.rendezvous, "--run-dir", str(run_dir.path),
    ]  # fmt: skip
    start_detached(command, run_dir.rendezvous_store_log)


def store_running_here(run: Run, launch: int) -> bool:
    return flock_held(run.run_dir.rendezvous_store_lock(launch))


# What a host worker's start_process replaces with the process's folder on that host
# (hostworker.processes.FOLDER, written out: the control plane sends tasks to host workers by name).
HOST_FOLDER = "{folder}"


def agent_key(run_id: int, node: int) -> str:
    """How a host worker names the agent it runs for a run's node (its reports say the same)."""
    return f"run-{run_id}-node-{node}"


def store_key(run_id: int) -> str:
    """How a run's rendezvous store is named (a Slurm job's, or a missing one in a log line)."""
    return f"run-{run_id}-store"


def send_to_host(host: Host, task: str, kwargs: dict[str, object]) -> None:
    """A task for the host worker on `host` (hostworker/tasks.py), by name: the control plane
    imports nothing of the host worker."""
    app.send_task(f"hostworker.tasks.{task}", kwargs=kwargs, queue=host.queue)


def agent_arguments(run: Run, folder: Path, node: int | str, rdzv: str, token: str) -> list[str]:
    """A node agent's command line; `node` and `rdzv` may be shell words the agent's starter
    expands (a Slurm job knows its node and its first node only once it runs)."""
    return [
        "--spec", str(RunDir(folder).spec_file),
        "--run-dir", str(folder),
        "--node-rank", str(node),
        "--rdzv-endpoint", rdzv,
        "--events-url", f"{settings.PUBLIC_URL}/api/runs/{run.pk}/events/",
        f"--run-token={token}",  # one word: a token may start with "-", which argparse takes for an option
        "--stop-requests",  # a preemption asks the ranks to checkpoint and stop (`request_stop`)
    ]  # fmt: skip


def agents_alive(run: Run, running: Iterable[str] | None = None) -> bool:
    """Whether any of the run's node agents still runs: on this host, it holds its lock file;
    elsewhere, its host's last beat lists it (`running`: the keys the hosts that are not lost
    run, when the caller has read them already, as a placement pass has).

    The lock, not a recorded pid, is the truth: a worker killed between starting an agent and
    saving its pid leaves no pid behind, but the agent still holds its lock.
    """
    if any(flock_held(lock) for lock in run.run_dir.agent_locks()):
        return True
    # On other hosts a lock may not be visible from here: their workers say what they run.
    if running is None:
        running = {key for host in Host.objects.exclude(status=Host.Status.LOST) for key in running_keys(host.running)}
    prefix = agent_key(run.pk, 0).removesuffix("0")
    return any(key.startswith(prefix) for key in running)


def missing_on_hosts(run: Run) -> list[str]:
    """What the run's current launch should run (its rendezvous store here, one agent a node on
    its hosts) that is not running: a start task the broker lost, or a process that died before
    its agent reported."""
    launch = Run.objects.values_list("launch_attempts", flat=True).get(pk=run.pk)
    nodes = sorted(set(DeviceClaim.objects.filter(run=run).values_list("node", flat=True)))
    missing = [store_key(run.pk)] if len(nodes) > 1 and not store_running_here(run, launch) else []
    expected = [agent_key(run.pk, node) for node in nodes]
    running = {
        item.get("key")
        for host in Host.objects.exclude(status=Host.Status.LOST)
        for item in host.running
        if item.get("launch") == launch
    }
    return missing + [key for key in expected if key not in running]


def has_local_agents(run: Run) -> bool:
    """Whether this host ever started agents for the run (their lock files are here)."""
    return bool(run.run_dir.agent_locks())


def request_cancel(run: Run) -> None:
    """Asks the agents this machine started to stop their ranks cleanly: a marker file they
    poll, and SIGTERM (`stop_agents`)."""
    run.folder.mkdir(parents=True, exist_ok=True)
    run.run_dir.cancel_marker.touch()
    stop_agents(run)


def request_stop(run: Run, reason: str) -> None:
    """Asks the run's ranks to checkpoint the step they agree on and stop (`RunDir.stop_request`,
    which they look for at every step's end): by a task to each host the run is placed on, which
    writes it in the run's folder there, or here for agents this machine started. Sent again
    while the run has not stopped (a lost message, an agent that removed a request older than
    its start) costs nothing: the ranks stop once."""
    claims = DeviceClaim.objects.filter(run=run).exclude(host__status=Host.Status.LOST).select_related("host")
    hosts = {claim.host.pk: claim.host for claim in claims}
    folder = str(run.folder.relative_to(settings.DATA_DIR))
    for host in hosts.values():
        send_to_host(host, "request_stop", {"folder": folder, "name": run.run_dir.stop_request.name, "reason": reason})
    if has_local_agents(run):
        tmp = run.run_dir.stop_request.with_name(run.run_dir.stop_request.name + ".tmp")
        tmp.write_text(reason)
        tmp.replace(run.run_dir.stop_request)


def stop_agents(run: Run) -> None:
    """SIGTERM to the run's agents, which cancels: each stops its ranks, which finish a save
    under way, and reports `cancelled`. By a stop task to each host the run is placed on (a
    host keeps the run's folder to itself, so no marker of ours would reach it), or here for
    agents this machine started."""
    # Not to a lost host: its agents went with it, and a stop waiting in its queue could end a
    # later launch there.
    claims = DeviceClaim.objects.filter(run=run).exclude(host__status=Host.Status.LOST).select_related("host")
    placed = {claim.node: claim.host for claim in claims}
    for node, host in sorted(placed.items()):
        send_to_host(host, "stop_process", {"key": agent_key(run.pk, node)})
    for pid in run.agent_pids:
        if is_alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
