"""A host worker's heartbeat: it beats at its interval, and at once when what the host runs
changes, so the devices of an agent that exited go back to the queue without waiting a beat."""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hostworker.config import HostConfig
from hostworker.heartbeat import Heartbeat
from hostworker.processes import Processes


def test_a_host_beats_at_once_when_a_process_it_runs_exits(tmp_path: Path) -> None:
    beats: queue.Queue[tuple[float, list[dict[str, object]]]] = queue.Queue()

    class ControlPlane(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            beats.put((time.monotonic(), body["running"]))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"status": "ready"}')

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), ControlPlane)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = HostConfig(
        name="h", control_url=f"http://127.0.0.1:{server.server_port}", join_token="t", address="127.0.0.1",
        broker_url="filesystem://", data_dir=tmp_path / "data", state_dir=tmp_path / "state", labels={},
        cpu_slots=1, heartbeat_s=60.0, python=sys.executable,
    )  # fmt: skip
    processes = Processes(config)
    agent = subprocess.Popen(["sleep", "60"])
    processes._write({"run-1-node-0": {"pid": agent.pid, "launch": 1}})  # as `start` records an agent
    heartbeat = Heartbeat(config, processes)
    try:
        assert heartbeat.register() == "ready"
        assert [p["key"] for p in beats.get(timeout=5)[1]] == ["run-1-node-0"]
        heartbeat.start()
        time.sleep(1.0)
        assert beats.empty()  # nothing changed: no beat before the 60 s interval
        agent.kill()
        agent.wait()
        exited_at = time.monotonic()
        beat_at, running = beats.get(timeout=10)  # long before the interval
        assert running == []
        assert beat_at - exited_at < 10
    finally:
        heartbeat.stop()
        server.shutdown()
        agent.kill()
