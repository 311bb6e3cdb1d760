"""A run's spec is parsed twice on its way from the API to a rank, and never refilled.

The control plane parses it at submit and stores it resolved; the launch writes it as stored;
the node agent reads only the `nodes` section and the world size (`NodePlan`), not the spec;
each rank parses the run's spec file (and fits it to a smaller world itself, when one formed). Real processes: the launch task's code in
this process, a real node agent and a real rank, counted through a `sitecustomize` that wraps
`RunSpec.from_dict` in every Python process the launch starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from runs.models import Run
from runs.tasks import launch_run
from training.config import RunSpec
from training.run_dir import RunDir

# What every process the launch starts imports before anything else: a count of its parses.
COUNTING_SITECUSTOMIZE = '''
import os, sys
if os.environ.get("FATHOM_TEST_PARSE_LOG"):
    from training import config

    _from_dict = config.RunSpec.from_dict.__func__

    def _counted(cls, data):
        with open(os.environ["FATHOM_TEST_PARSE_LOG"], "a") as log:
            main = getattr(sys.modules.get("__main__"), "__spec__", None)  # python -m NAME: NAME
            log.write(f"{main.name if main else sys.argv[0]}\\n")
        return _from_dict(cls, data)

    config.RunSpec.from_dict = classmethod(_counted)
'''

AGENT_DEADLINE_S = 300


def _wait_for_outcome(spool: Path, deadline: float) -> list[dict[str, Any]]:
    while time.monotonic() < deadline:
        events = [json.loads(line) for line in spool.read_text().splitlines()] if spool.exists() else []
        if any(e["kind"] in ("succeeded", "failed") for e in events):
            return events
        time.sleep(0.2)
    raise AssertionError(f"no outcome in {spool} after {AGENT_DEADLINE_S} s")


@pytest.mark.django_db
def test_the_spec_is_parsed_once_at_submit_and_once_by_the_rank(
    alice_api, settings, tmp_path, monkeypatch
) -> None:
    settings.RUNS_DIR = tmp_path / "runs"
    parse_log = tmp_path / "parses.log"
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    # The launcher sets the agents' PYTHONPATH itself; the python it starts them with adds ours.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}:$PYTHONPATH" exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    settings.TRAINING_PYTHON = str(python)
    monkeypatch.setenv("FATHOM_TEST_PARSE_LOG", str(parse_log))

    in_control_plane: list[dict[str, Any]] = []
    from_dict = RunSpec.from_dict.__func__  # type: ignore[attr-defined]

    def counted(cls: type[RunSpec], data: dict[str, Any]) -> RunSpec:
        in_control_plane.append(data)
        return from_dict(cls, data)

    monkeypatch.setattr(RunSpec, "from_dict", classmethod(counted))

    spec = {"train": {"steps": 2, "warmup_steps": 1, "checkpoint_interval": 2}}
    created = alice_api.post("/api/runs/", {"name": "counted", "spec": spec}, format="json")
    assert created.status_code == 201, created.content
    assert len(in_control_plane) == 1, "submit parses the spec once"

    launch_run(created.json()["id"])  # what the Celery worker runs; here, so its parses are counted
    run = Run.objects.get(pk=created.json()["id"])
    try:
        events = _wait_for_outcome(RunDir(run.folder).node(0).spool_file, time.monotonic() + AGENT_DEADLINE_S)
    finally:
        for pid in run.agent_pids:
            try:
                os.killpg(pid, signal.SIGKILL)  # the agent may still be retrying the absent control plane
            except ProcessLookupError:
                pass
    assert events[-1]["kind"] == "succeeded", events[-1]
    assert len(in_control_plane) == 1, "the launch parses nothing"

    # `python -m training.agent` runs the package's __main__.
    by_process = Counter(line.strip().removesuffix(".__main__") for line in parse_log.read_text().splitlines())
    assert by_process == {"training.train": 1}, by_process
