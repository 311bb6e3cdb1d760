"""`make run`'s Ctrl-C stops what it started: the run under way is cancelled through the worker
and host worker, then web, worker, beat and host worker go, and nothing of Fathom keeps running.

tools/run_embedded.py itself, as `make run` starts it (without the demo: FATHOM_DEMO=0), with a
run submitted through the API it prints the token of.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.platform.conftest import REPO
from tests.ports import free_port

pytestmark = pytest.mark.slow


def started_with(data_dir: Path) -> list[str]:
    """Every live process whose environment has this FATHOM_DATA_DIR (all that Fathom started
    inherit it): pid and command line."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            if f"FATHOM_DATA_DIR={data_dir}".encode() in environ:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append(f"{proc.name}: {command}")
        except OSError:  # gone, or not a process
            continue
    return found


def test_ctrl_c_cancels_the_runs_then_stops_every_process(tmp_path: Path) -> None:
    port = free_port()
    env = dict(
        os.environ, FATHOM_DEMO="0", FATHOM_PORT=str(port), FATHOM_DATA_DIR=str(tmp_path), FATHOM_HOST_CPU_SLOTS="1",
        FATHOM_HOST_NAME="make-run-test", OMP_NUM_THREADS="1",
    )  # fmt: skip
    env.pop("FATHOM_JOIN_TOKEN", None)
    fathom = subprocess.Popen(
        [sys.executable, "tools/run_embedded.py"], cwd=REPO, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    assert fathom.stdout is not None
    said = []
    try:
        for line in fathom.stdout:
            said.append(line)
            if "Press Ctrl-C to stop." in line:
                break
        printed = "".join(said)
        token = re.search(r"api token: (\S+)", printed)
        assert token is not None, printed
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Token {token[1]}"})
        spec = {"train": {"steps": 100000, "checkpoint_interval": 1000}}
        run_id = api.post("/api/runs/", json={"name": "long", "spec": spec}).json()["id"]
        deadline = time.monotonic() + 300
        while (run := api.get(f"/api/runs/{run_id}/").json())["step"] < 2:
            assert time.monotonic() < deadline and run["status"] in ("queued", "starting", "running"), run
            time.sleep(1)

        fathom.send_signal(signal.SIGINT)
        rest, _ = fathom.communicate(timeout=180)
    finally:
        if fathom.poll() is None:
            fathom.kill()
    printed = "".join(said) + rest
    assert fathom.returncode == 0, printed
    assert f"run {run_id} (long): cancelling" in printed
    assert "every run and deployment has ended" in printed
    # Nothing it started runs on: no agent or rank of the run, no web, worker, beat or host worker.
    assert started_with(tmp_path) == []
