"""The supervisor's mechanics with stand-in replica programs (real processes that exit at once or
never answer /health), so backoff, timeouts and stop are seen in seconds. The same paths with
real vLLM replicas: test_deployment.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from serving.deployment_config import DeploymentConfig
from serving.replica_adapters import request_adapters
from serving.state import ReplicaEvent, read_events, read_state
from serving.supervisor import Supervisor, launch_detached
from serving.vllm import OptionError, ReplicaOptions
from tests.ports import free_port
from tests.serving.conftest import process_alive


def stand_in(tmp_path: Path, script: str) -> str:
    """An executable that the supervisor runs in place of the vLLM interpreter."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def config(tmp_path: Path, python: str, **overrides: object) -> DeploymentConfig:
    values: dict = {
        "name": "tiny",
        "export": str(tmp_path / "ckpt"),
        "state_dir": str(tmp_path / "state"),
        "python": python,
        "replicas": 1,
        "restart_backoff_s": 0.05,
        "restart_backoff_max_s": 0.2,
        "health_interval_s": 0.1,
        "stop_grace_s": 2.0,
    }
    values.update(overrides)
    return DeploymentConfig(**values)


async def wait_for(condition, timeout_s: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


async def test_a_replica_that_keeps_dying_is_restarted_with_doubling_capped_delays(tmp_path: Path) -> None:
    events: list[ReplicaEvent] = []
    # Each death its own (a different line each time): no sign that a restart cannot help.
    dies = stand_in(tmp_path, 'echo "RuntimeError: lost at $(date +%s%N)"; exit 3')
    supervisor = Supervisor(config(tmp_path, dies), on_event=events.append)
    await supervisor.start()
    await wait_for(lambda: sum(e.kind == "replica_restarting" for e in events) >= 5)
    await supervisor.stop()

    died = [e for e in events if e.kind == "replica_died"]
    assert {e.exit_code for e in died} == {3}
    delays = [e.delay_s for e in events if e.kind == "replica_restarting"][:5]
    assert delays == [0.05, 0.1, 0.2, 0.2, 0.2]
    restarts = [e.restarts for e in events if e.kind == "replica_restarting"][:5]
    assert restarts == [1, 2, 3, 4, 5]
    assert events[-1].kind == "replica_stopped"
    # The callback and events.jsonl tell the same story.
    assert [e.kind for e in read_events(tmp_path / "state")[0]] == [e.kind for e in events]


async def test_a_replica_that_dies_the_same_way_at_two_starts_fails_with_its_logs_error_line(tmp_path: Path) -> None:
    events: list[ReplicaEvent] = []
    dies = stand_in(tmp_path, 'echo "starting"; echo "RuntimeError: no kernel takes this dtype"; echo "shutting down"; exit 3')
    supervisor = Supervisor(config(tmp_path, dies), on_event=events.append)
    await supervisor.start()
    await wait_for(lambda: any(e.kind == "replica_failed" for e in events))
    await asyncio.sleep(0.5)  # no third start comes
    kinds = [e.kind for e in events]
    assert kinds == [
        "replica_starting", "replica_died", "replica_restarting", "replica_starting", "replica_died", "replica_failed",
    ]  # fmt: skip
    assert events[-1].message == (
        "failed the same way at 2 starts in a row (exit code 3): RuntimeError: no kernel takes this dtype"
    )
    assert events[-1].exit_code == 3
    assert supervisor.replicas[0].phase == "failed" and read_state(tmp_path / "state").replicas[0].phase == "failed"  # type: ignore[union-attr]
    await supervisor.stop()
    assert [e.kind for e in events][-1] == "replica_stopped"


async def test_a_replica_told_to_give_up_at_its_first_death_fails_at_its_only_start(tmp_path: Path) -> None:
    events: list[ReplicaEvent] = []
    dies = stand_in(tmp_path, 'echo "RuntimeError: no kernel takes this dtype"; exit 3')
    supervisor = Supervisor(config(tmp_path, dies, failed_starts_to_give_up=1), on_event=events.append)
    await supervisor.start()
    await wait_for(lambda: any(e.kind == "replica_failed" for e in events))
    await asyncio.sleep(0.5)  # no second start comes
    assert [e.kind for e in events] == ["replica_starting", "replica_died", "replica_failed"]
    assert events[-1].message == "failed at its only start (exit code 3): RuntimeError: no kernel takes this dtype"
    await supervisor.stop()


async def test_a_replica_whose_first_generation_fails_is_never_ready_and_gives_up(tmp_path: Path) -> None:
    # /health answers, the first completion is a 500: an engine that dies on its first request.
    python = tmp_path / "python"
    python.write_text(SERVER.format(first_post="self.send_response(500); self.end_headers()", later_posts="pass"))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    events: list[ReplicaEvent] = []
    supervisor = Supervisor(config(tmp_path, str(python), ready_timeout_s=30), on_event=events.append)
    await supervisor.start()
    await wait_for(lambda: any(e.kind == "replica_failed" for e in events))
    await supervisor.stop()
    assert "replica_ready" not in [e.kind for e in events]
    died = [e for e in events if e.kind == "replica_died"]
    assert len(died) == 2 and all(e.message.startswith("answered /health but generated no token") for e in died)
    assert all(e.pid is not None and not process_alive(e.pid) for e in died)


async def test_a_supervisor_with_an_owner_stops_its_replicas_and_exits_once_the_owner_is_gone(tmp_path: Path) -> None:
    owner = subprocess.Popen(["sleep", "600"])
    cfg = config(tmp_path, stand_in(tmp_path, "exec sleep 600"), owner_pid=owner.pid, health_interval_s=0.2)
    supervisor = launch_detached(cfg, python=sys.executable)
    try:
        await wait_for(lambda: (s := read_state(tmp_path / "state")) is not None and s.replicas[0].pid is not None)
        replica_pid = read_state(tmp_path / "state").replicas[0].pid  # type: ignore[union-attr]
        assert replica_pid is not None and process_alive(replica_pid)
        owner.kill()  # as a Celery worker killed mid-task, or a bench past its timeout
        owner.wait()
        await wait_for(lambda: not process_alive(supervisor), timeout_s=30)
        assert not process_alive(replica_pid)
        assert "owner" in (tmp_path / "state" / "supervisor.log").read_text()
    finally:
        owner.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor, signal.SIGKILL)


def three_free_ports() -> int:
    """The first of three consecutive ports that nothing holds now."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as probes:
            try:
                for port in (first + 1, first + 2):
                    probes.enter_context(socket.socket()).bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise AssertionError("no three consecutive free ports")


async def test_replicas_take_ports_of_the_range_that_nothing_holds_and_one_left_without_is_retried(
    tmp_path: Path,
) -> None:
    first = three_free_ports()
    with socket.socket() as another_program:
        another_program.bind(("127.0.0.1", first))
        another_program.listen()
        events: list[ReplicaEvent] = []
        # Stand-ins that never bind: only the supervisor keeps two starting replicas apart.
        cfg = config(tmp_path, stand_in(tmp_path, "exec sleep 600"), replicas=3, ports=(first, first + 2))
        supervisor = Supervisor(cfg, on_event=events.append)
        await supervisor.start()
        await wait_for(lambda: any(e.kind == "replica_restarting" for e in events))
        state = read_state(tmp_path / "state")
        assert state is not None
        assert sorted(r.port for r in state.replicas if r.phase == "starting") == [first + 1, first + 2]
        died = next(e for e in events if e.kind == "replica_died")
        assert died.exit_code is None and died.message.startswith("not started: every port in ")
        await supervisor.stop()


async def test_a_replica_that_never_becomes_healthy_is_killed_and_restarted(tmp_path: Path) -> None:
    events: list[ReplicaEvent] = []
    supervisor = Supervisor(
        config(tmp_path, stand_in(tmp_path, "exec sleep 600"), ready_timeout_s=0.5), on_event=events.append
    )
    await supervisor.start()
    await wait_for(lambda: any(e.kind == "replica_restarting" for e in events))
    died = next(e for e in events if e.kind == "replica_died")
    assert "not healthy after 0.5 s" in died.message
    assert died.pid is not None and not process_alive(died.pid)
    await supervisor.stop()


async def test_stop_kills_a_starting_replica_with_its_children_and_records_it(tmp_path: Path) -> None:
    # The stand-in starts a child of its own, as vLLM's server starts its engine core.
    python = stand_in(tmp_path, 'sleep 600 & echo $! > "$(dirname "$0")/child.pid"; wait')
    events: list[ReplicaEvent] = []
    supervisor = Supervisor(config(tmp_path, python), on_event=events.append)
    await supervisor.start()
    child_pid_file = tmp_path / "child.pid"
    await wait_for(lambda: child_pid_file.exists() and child_pid_file.read_text().strip())
    child = int(child_pid_file.read_text())
    replica_pid = supervisor.replicas[0].pid
    assert replica_pid and process_alive(replica_pid) and process_alive(child)

    await supervisor.stop()
    assert not process_alive(replica_pid) and not process_alive(child)
    assert [e.kind for e in events] == ["replica_starting", "replica_stopped"]
    state = read_state(tmp_path / "state")
    assert state is not None and state.stopping and state.replicas[0].phase == "stopped"
    assert state.supervisor_pid == os.getpid()


# A stand-in vLLM server: /health says 200; the first completion and the later ones as given.
SERVER = f"""#!{sys.executable}
import sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

posts = 0

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()

    def do_POST(self):
        global posts
        posts += 1
        if posts == 1:
            {{first_post}}
        else:
            {{later_posts}}

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""
# A replica whose engine gets stuck once ready: its first token comes, then no completion does.
STUCK_SERVER = SERVER.format(
    first_post="self.send_response(200); self.end_headers(); self.wfile.write(b'{{}}')",
    later_posts="time.sleep(600)",
)


async def test_a_replica_that_answers_health_but_never_generates_is_taken_out_then_restarted(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(STUCK_SERVER)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    cfg = config(
        tmp_path,
        str(python),
        liveness_interval_s=0.1,
        liveness_timeout_s=0.3,
        unhealthy_after=2,
        restart_unhealthy_after_s=0.5,
        ready_timeout_s=30,
    )
    events: list[ReplicaEvent] = []
    supervisor = Supervisor(cfg, on_event=events.append)
    await supervisor.start()
    await wait_for(lambda: any(e.kind == "replica_restarting" for e in events))
    await supervisor.stop()
    kinds = [e.kind for e in events]
    assert kinds[:5] == ["replica_starting", "replica_ready", "replica_unhealthy", "replica_died", "replica_restarting"]
    died = events[3]
    assert "unhealthy for 0.5 s; killed" in died.message and died.exit_code in (-15, -9)
    assert died.pid is not None and not process_alive(died.pid)


# A replica with LoRA on: it completes, and loads or unloads adapters as vLLM's runtime endpoints
# do (one named "broken" fails to load, as a folder vLLM cannot read does); its argv is in its log.
ADAPTER_SERVER = f"""#!{sys.executable}
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

print(" ".join(sys.argv), flush=True)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        print(self.path, body, flush=True)
        failed = self.path == "/v1/load_lora_adapter" and body["lora_name"] == "broken"
        self.send_response(400 if failed else 200); self.end_headers()
        self.wfile.write(b"cannot read the adapter" if failed else b"{{}}")

    def log_message(self, *args):
        pass

port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


async def test_sighup_loads_and_unloads_the_config_files_adapters_on_the_running_replica(tmp_path: Path) -> None:
    python = tmp_path / "python"
    python.write_text(ADAPTER_SERVER)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    state = tmp_path / "state"
    cfg = config(
        tmp_path, str(python), health_interval_s=0.2, adapters={"first": "/adapters/first"},
        options=ReplicaOptions(max_loras=2, max_lora_rank=8),
    )  # fmt: skip
    supervisor = launch_detached(cfg, python=sys.executable)
    try:
        await wait_for(lambda: (s := read_state(state)) is not None and s.replicas[0].phase == "ready")
        (replica,) = read_state(state).replicas  # type: ignore[union-attr]
        assert replica.adapters == ["first"]
        log = Path(replica.log).read_text()
        assert "--enable-lora --max-loras 2 --max-lora-rank 8 --lora-modules first=/adapters/first" in log

        assert request_adapters(state, {"second": "/adapters/second", "broken": "/adapters/broken"})
        await wait_for(lambda: any(e.kind == "replica_adapters" for e in read_events(state)[0]))
        (changed,) = [e for e in read_events(state)[0] if e.kind == "replica_adapters"]
        assert (changed.loaded, changed.unloaded) == (["second"], ["first"])
        assert changed.message == "could not load or unload broken: cannot read the adapter"
        (now,) = read_state(state).replicas  # type: ignore[union-attr]
        assert (now.adapters, now.pid, now.restarts) == (["second"], replica.pid, 0)  # no restart
        log = Path(replica.log).read_text()
        assert "/v1/unload_lora_adapter {'lora_name': 'first'}" in log
        assert "/v1/load_lora_adapter {'lora_name': 'second', 'lora_path': '/adapters/second'}" in log
        # The config file holds the new set: a replica started from now on starts with it.
        assert DeploymentConfig.from_dict(json.loads((state / "deployment.json").read_text())).adapters == {
            "second": "/adapters/second", "broken": "/adapters/broken",
        }  # fmt: skip
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor, signal.SIGKILL)
        # The fake replica is a script the launcher's PR_SET_PDEATHSIG line never reaches: it
        # would outlive its killed supervisor.
        for leftover in (read_state(state).replicas if read_state(state) else []):
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.killpg(leftover.pid, signal.SIGKILL)  # type: ignore[arg-type]


def test_adapters_need_lora_on_and_names_of_their_own() -> None:
    with pytest.raises(OptionError, match="max_loras") as refused:
        config(Path("/tmp/x"), "python", adapters={"tuned": "/adapters/tuned"})
    assert refused.value.field == "max_loras"
    lora = ReplicaOptions(max_loras=1)
    for bad in ({"tiny": "/a"}, {"two words": "/a"}, {"tuned": ""}):
        with pytest.raises(OptionError) as refused:
            config(Path("/tmp/x"), "python", adapters=bad, options=lora)
        assert refused.value.field == "adapters"
    with pytest.raises(OptionError, match="max_lora_rank") as refused:
        ReplicaOptions(max_loras=1, max_lora_rank=12)
    assert "1, 8, 16, 32" in str(refused.value)
