"""The registry says what is true of a real run: checkpoints the trainer pruned are marked so (and
cannot be deployed), and a node agent that stops reporting is shown as silent until it reports
again. Real processes throughout: the web process, a Celery worker with beat, the node agent
(stopped with SIGSTOP as a hung host would be) and its rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from runs.models import Run
from tests.platform.test_run_lifecycle import api, wait_until

pytestmark = pytest.mark.slow

# Longer than the control plane's FATHOM_NODE_SILENT_AFTER (15 s) plus its check interval (5 s).
SILENT_WAIT_SECONDS = 60


def agent_process(flock_pid: int) -> int:
    """The node agent: the launcher starts it under `flock`, whose pid is the one recorded."""
    children = Path(f"/proc/{flock_pid}/task/{flock_pid}/children").read_text().split()
    for child in children:
        if b"training.agent" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"no training.agent process under flock {flock_pid}: children {children}")


@pytest.mark.django_db(transaction=True)
def test_pruned_checkpoints_are_marked_and_a_stopped_agent_shows_silent_until_it_reports(
    alice, live_web, celery_worker_with_beat
):
    client = api(live_web, alice)
    spec = {"train": {"steps": 100000, "warmup_steps": 2, "checkpoint_interval": 4, "keep_checkpoints": 2}}
    created = client.post("/api/runs/", json={"name": "registry", "spec": spec})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    run = Run.objects.get(pk=run_id)
    try:
        wait_until(lambda: run.checkpoints.filter(pruned_at__isnull=False).count() >= 2, 300, "two pruned checkpoints")
        rows = client.get(f"/api/runs/{run_id}/checkpoints/").json()
        pruned = [r for r in rows if r["pruned_at"]]
        assert all(not Path(r["path"]).exists() for r in pruned)
        kept = [r for r in rows if not r["pruned_at"]]
        assert kept and Path(kept[-1]["path"]).exists()  # the newest is never pruned
        assert [e.data["step"] for e in run.events.filter(kind="checkpoint_pruned").order_by("seq")][:2] == [
            r["step"] for r in pruned[:2]
        ]
        refused = client.post("/api/deployments/", json={"checkpoint": pruned[0]["id"]})
        assert refused.status_code == 400, refused.text
        assert "deleted by the trainer (train.keep_checkpoints)" in refused.json()["checkpoint"][0]

        agent = agent_process(Run.objects.get(pk=run_id).agent_pids[0])
        os.kill(agent, signal.SIGSTOP)
        try:
            wait_until(lambda: run.events.filter(kind="node_silent").exists(), SILENT_WAIT_SECONDS, "node-0 shown silent")
            assert Run.objects.get(pk=run_id).silent_nodes == ["node-0"]
            assert Run.objects.get(pk=run_id).status == "running"  # silent is not failed
        finally:
            os.kill(agent, signal.SIGCONT)
        wait_until(lambda: run.events.filter(kind="node_reporting").exists(), 60, "node-0 reporting again")
        assert Run.objects.get(pk=run_id).silent_nodes == []
        silent = run.events.get(kind="node_silent")
        back = run.events.get(kind="node_reporting")
        assert silent.data["node"] == back.data["node"] == "node-0"
        assert back.seq > silent.seq and back.data["silent_s"] >= 15
    finally:
        client.post(f"/api/runs/{run_id}/cancel/")
        wait_until(lambda: Run.objects.get(pk=run_id).status in Run.FINISHED, 120, "the run to stop")
