"""Prepares a run's folder and starts its node agents as detached processes.

Agents outlive the Celery task that starts them: the task returns as soon as they run. Each
agent is started under `flock -n` on a per-node lock file, so a launch delivered twice (a
worker killed after it claimed the run) can never start a second agent for the same node. A run
of several nodes also gets its rendezvous store as a process of its own
(training/agent/rendezvous_store.py), so that losing node 0's agent does not end the job.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
from pathlib import Path

from django.conf import settings

from controlplane.processes import flock_held, free_port, is_alive, start_detached
from runs.models import Run
from training.run_dir import RunDir


def prepare(run: Run) -> tuple[Path, str]:
    """Writes the run's spec file; returns the folder and a fresh run token.

    The spec is written as it was stored at submit, resolved and checked (data paths included,
    filled in from the objects the run names): nothing here parses or changes it.
    """
    folder = run.run_dir
    folder.logs_dir.mkdir(parents=True, exist_ok=True)
    # A resumed run starts in the folder its cancel was requested in: the request is spent.
    folder.cancel_marker.unlink(missing_ok=True)
    tmp = folder.spec_file.with_name(folder.spec_file.name + ".tmp")
    tmp.write_text(json.dumps(run.spec, indent=2, sort_keys=True))  # as RunSpec.to_json writes it
    tmp.replace(folder.spec_file)
    return folder.path, secrets.token_urlsafe(32)


def start_agents(run: Run, folder: Path, token: str) -> list[int]:
    run_dir = RunDir(folder)
    rdzv = f"127.0.0.1:{free_port()}"
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
            *agent_arguments(run, folder, node, rdzv, token), *store_args,
        ]  # fmt: skip
        pids.append(start_detached(command, run_dir.agent_log(node)))
    return pids


def agent_arguments(run: Run, folder: Path, node: int, rdzv: str, token: str) -> list[str]:
    return [
        "--spec", str(RunDir(folder).spec_file),
        "--run-dir", str(folder),
        "--node-rank", str(node),
        "--rdzv-endpoint", rdzv,
        "--events-url", f"{settings.PUBLIC_URL}/api/runs/{run.pk}/events/",
        f"--run-token={token}",  # one word: a token may start with "-", which argparse takes for an option
    ]  # fmt: skip


def agents_alive(run: Run) -> bool:
    """Whether any of the run's node agents on this host still runs: it holds its lock file.

    The lock, not a recorded pid, is the truth: a worker killed between starting an agent and
    saving its pid leaves no pid behind, but the agent still holds its lock.
    """
    return any(flock_held(lock) for lock in run.run_dir.agent_locks())


def has_local_agents(run: Run) -> bool:
    """Whether this host ever started agents for the run (their lock files are here)."""
    return bool(run.run_dir.agent_locks())


def request_cancel(run: Run) -> None:
    """Asks the agents to stop their ranks cleanly: a marker file they poll, and SIGTERM."""
    run.folder.mkdir(parents=True, exist_ok=True)
    run.run_dir.cancel_marker.touch()
    for pid in run.agent_pids:
        if is_alive(pid):
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
