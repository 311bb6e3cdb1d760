"""Helpers for the fault tests: real node agents as subprocesses, a real HTTP ingest endpoint.

Every wait has a deadline, so a hang fails the test instead of blocking it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.ports import free_port
from training.config import RunSpec, tiny

ROOT = Path(__file__).resolve().parents[2]
# Seconds an agent run may take before the test fails instead of hanging.
AGENT_TIMEOUT = 300.0


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class AgentRun:
    node_rank: int
    run_dir: Path
    process: subprocess.Popen[bytes]
    output: Path

    def wait(self, timeout: float = AGENT_TIMEOUT) -> int:
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(
                f"agent node {self.node_rank} still running after {timeout:.0f} s\n{self.tail()}"
            ) from None

    def tail(self, lines: int = 60) -> str:
        text = self.output.read_text(errors="replace") if self.output.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def failures(self) -> str:
        """Each failure and restart the agent reported, then the tail of every rank's log: what
        an assertion on the restarts shows when a run restarted more often than the test meant."""
        lines = [json.dumps(e) for e in self.events if e["kind"] in ("rank_failed", "restarting", "resumed")]
        for log in sorted((self.run_dir / "logs").glob("rank*.log")):
            tail = log.read_text(errors="replace").splitlines()[-25:]
            lines += [f"--- {log.name}", *tail]
        return "\n".join(lines)

    @property
    def events(self) -> list[dict[str, Any]]:
        """This node's spooled events: {"seq", "kind", "time", "data"}, in seq order."""
        return read_jsonl(self.run_dir / f"node{self.node_rank}" / "spool.jsonl")

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [e["data"] | {"time": e["time"]} for e in self.events if e["kind"] == kind]

    def losses(self) -> dict[int, float]:
        """The loss of every step, as last reported (a resumed run reports replayed steps again)."""
        return {m["step"]: m["loss"] for m in self.of_kind("metrics")}


@dataclass
class Agents:
    """Starts node agents as subprocesses and cleans up whatever is left at the end of a test."""

    tmp_path: Path
    entrypoint: str
    started: list[AgentRun] = field(default_factory=list)

    def write_spec(self, spec: RunSpec, name: str = "spec.json") -> Path:
        path = self.tmp_path / name
        path.write_text(spec.to_json())
        return path

    def start(
        self,
        spec: RunSpec,
        run_dir: Path,
        *,
        node_rank: int = 0,
        rdzv_endpoint: str | None = None,
        events_url: str | None = None,
        run_token: str | None = None,
        extra: tuple[str, ...] = (),
    ) -> AgentRun:
        run_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.write_spec(spec, f"spec-{run_dir.name}-node{node_rank}.json")
        command = [
            sys.executable,
            "-m",
            "training.agent",
            "--spec",
            str(spec_path),
            "--run-dir",
            str(run_dir),
            "--node-rank",
            str(node_rank),
            "--entrypoint",
            self.entrypoint,
        ]
        if rdzv_endpoint:
            command += ["--rdzv-endpoint", rdzv_endpoint]
        if events_url:
            command += ["--events-url", events_url, f"--run-token={run_token or ''}"]
        command += list(extra)
        output = run_dir / f"agent-node{node_rank}.out"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with open(output, "ab") as out:
            process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        run = AgentRun(node_rank=node_rank, run_dir=run_dir, process=process, output=output)
        self.started.append(run)
        return run

    def run(self, spec: RunSpec, run_dir: Path, **kwargs: Any) -> AgentRun:
        agent = self.start(spec, run_dir, **kwargs)
        agent.wait()
        return agent

    def cleanup(self) -> None:
        for run in self.started:
            if run.process.poll() is None:
                run.process.send_signal(signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
                run.process.wait()


# --- the control plane's ingest endpoint, as the contract describes it -------------------


class IngestServer:
    """`POST /events` with a bearer token; stores events per source, dedupes on seq."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.port = free_port()
        self.events: dict[str, dict[int, dict[str, Any]]] = {}
        self.duplicates = 0
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events"

    def start(self) -> None:
        ingest = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                if self.headers.get("Authorization") != f"Bearer {ingest.token}":
                    self._answer(401, {"detail": "bad token"})
                    return
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with ingest.lock:
                    held = ingest.events.setdefault(body["source"], {})
                    for event in body["events"]:
                        if event["seq"] in held:
                            ingest.duplicates += 1
                        else:
                            held[event["seq"]] = event
                    last_seq = max(held, default=0)
                self._answer(200, {"last_seq": last_seq})

            def _answer(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def held(self, source: str) -> list[dict[str, Any]]:
        with self.lock:
            return [self.events.get(source, {})[seq] for seq in sorted(self.events.get(source, {}))]


def training_spec(
    *,
    steps: int = 12,
    checkpoint_interval: int = 4,
    faults: list[dict[str, Any]] | None = None,
    nodes: dict[str, Any] | None = None,
    dp: int = 2,
    async_checkpoint: bool = False,
) -> RunSpec:
    """The tiny recipe cut to seconds per run: 4 layers, dim 64, seq 32, two data-parallel ranks."""
    data = tiny(dp=dp).to_dict()
    data["model"]["seq_len"] = 32
    # Synchronous saves unless asked: these tests assert which checkpoint a fault at a given step
    # resumes from, which a background save committing a few steps later (on a busy host) would make a race.
    data["train"].update(
        steps=steps, checkpoint_interval=checkpoint_interval, warmup_steps=2, async_checkpoint=async_checkpoint
    )
    # Tests wait 2 s for a silent rank instead of production's 10 s.
    data["nodes"].update({"heartbeat_timeout": 2.0, **(nodes or {})})
    data["faults"] = faults or []
    return RunSpec.from_dict(data)


def fault_fired_at(run_dir: Path) -> float:
    """When the (single) injected fault fired, from the marker the rank wrote before firing it."""
    (marker,) = (run_dir / "faults").glob("*.fired")
    return float(json.loads(marker.read_text())["time"])
