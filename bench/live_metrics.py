"""Live metrics from a point's birth in a rank to a browser's websocket, through every real hop.

For each backend (the embedded default: SQLite + in-memory channel layer; and PostgreSQL +
Redis), a real web process (uvicorn, as `make run` starts it) serves the control plane. A real
node agent (`python -m training.agent`, the uplink at its default settings) runs one rank, which
is this module in rank mode: it writes metrics points to the events file with the trainer's own
`EventLog`, stamped with their birth time, at a steady rate. The agent tails the file, spools,
and posts the points to `POST /api/runs/<id>/events/`; the control plane stores and publishes
them; a websocket client follows the run as the dashboard does. Latency is websocket receipt
minus the point's birth time (same clock, same machine). Two rates: a normal run (10 points/s,
a step every 100 ms) and 1,000 points/s. First, the same agent posts to a bare HTTP endpoint, to
tell the uplink's share (rank → events file → agent) from the control plane's.

    python -m bench.live_metrics            # ends with one key=value summary line
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# (name, points per second, seconds)
LOADS = (("normal", 10, 30), ("1000/s", 1000, 10))
LOAD_FILE = "bench-load.json"  # in the run folder: what the rank writes, and how fast


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SETUP = """
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from runs.models import Run
from launch.run_agents import node_token
user, _ = get_user_model().objects.get_or_create(username="bench")
runs = [Run.objects.create(owner=user, name=f"bench-{i}", spec={}, status="running", token_launch=1) for i in range(N)]
print(Token.objects.get_or_create(user=user)[0].key, *[f"{r.pk}:{node_token(r.pk, 1, 0)}" for r in runs])
"""


def ensure_postgres_database(name: str) -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")


def start_agent(
    url: str, run_id: int, token: str, rate: int, seconds: int, work: Path, path: str = ""
) -> subprocess.Popen[bytes]:
    """A node agent with default settings whose one rank writes `rate` points/s for `seconds`."""
    sys.path.insert(0, str(REPO))
    from training.config import tiny

    run_dir = work / f"run-{run_id}"
    run_dir.mkdir(parents=True)
    (run_dir / LOAD_FILE).write_text(json.dumps({"rate": rate, "seconds": seconds}))
    spec_path = work / f"spec-{run_id}.json"
    spec_path.write_text(tiny().to_json())
    command = [
        sys.executable, "-m", "training.agent", "--spec", str(spec_path), "--run-dir", str(run_dir),
        "--entrypoint", "bench.live_metrics", "--no-standby",
        "--events-url", url + (path or f"/api/runs/{run_id}/events/"), f"--run-token={token}",
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    with open(work / f"agent-{run_id}.out", "wb") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


async def follow(url: str, run_id: int, user_token: str, expected: int, start: asyncio.Event) -> list[float]:
    """Seconds from birth to receipt of each metrics point of run `run_id`, as a browser gets them."""
    import websockets
    from websockets.typing import Origin

    latencies: list[float] = []
    ws_url = url.replace("http", "ws") + f"/ws/runs/{run_id}/?after=0"
    async with websockets.connect(ws_url, additional_headers={"Authorization": f"Token {user_token}"}, origin=Origin(url)) as ws:
        start.set()
        while len(latencies) < expected:
            message = json.loads(await ws.recv())
            now = time.time()
            if message.get("type") == "events":
                latencies.extend(now - e["time"] for e in message["events"] if e["kind"] == "metrics")
    return latencies


def run_backend(name: str, extra_env: dict[str, str]) -> dict[str, tuple[float, float, float]]:
    import httpx

    work = Path(tempfile.mkdtemp(prefix=f"fathom-bench-{name}-"))
    env = dict(os.environ, FATHOM_DATA_DIR=str(work / "data"), OMP_NUM_THREADS="1", LOG_LEVEL="WARNING", **extra_env)
    manage = [sys.executable, str(REPO / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, check=True)
    setup = SETUP.replace("range(N)", f"range({len(LOADS)})")
    token, *runs = subprocess.run(
        [*manage, "shell", "-c", setup], env=env, check=True, capture_output=True, text=True
    ).stdout.split()[-1 - len(LOADS) :]
    agent_tokens = dict(run.split(":") for run in runs)  # run id: its node 0's token
    run_ids = list(agent_tokens)
    sys.path.insert(0, str(REPO / "platform"))
    from controlplane.web import web_command

    port = free_port()
    server = subprocess.Popen(
        web_command(port), cwd=REPO / "platform", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    results: dict[str, tuple[float, float, float]] = {}
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/login/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        for (load, rate, seconds), run_id in zip(LOADS, run_ids, strict=True):

            async def measure(run_id: int = int(run_id), rate: int = rate, seconds: int = seconds) -> list[float]:
                connected = asyncio.Event()
                following = asyncio.create_task(follow(url, run_id, token, rate * seconds, connected))
                await connected.wait()
                agent = start_agent(url, run_id, agent_tokens[str(run_id)], rate, seconds, work)
                try:
                    return await asyncio.wait_for(following, timeout=seconds * 6 + 60)
                finally:
                    await asyncio.to_thread(agent.wait, 60)

            latencies = asyncio.run(measure())
            ms = sorted(1000 * x for x in latencies)
            p50 = statistics.median(ms)
            p99 = ms[int(0.99 * (len(ms) - 1))]
            results[load] = (p50, p99, float(len(ms)))
            print(f"{name:<9} {load:<7} points={len(ms)}  p50={p50:.1f} ms  p99={p99:.1f} ms  max={ms[-1]:.1f} ms", flush=True)
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:  # a websocket it still holds open: the figures are in
            server.kill()
            server.wait()
    return results


def uplink_only(rate: int, seconds: int) -> tuple[float, float]:
    """Birth → arrival at a bare ingest endpoint (no database, no channel layer): the share of the
    latency that the rank, the events file and the agent's uplink take."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    latencies: list[float] = []
    last = [0]

    class Ingest(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as uvicorn does
        # TCP_NODELAY, as uvicorn's sockets have: http.server writes the headers and the body in
        # two sends, and with Nagle on the body waited for the agent's delayed ACK (~30 ms of the
        # 1,000 points/s figure was this endpoint's, not the uplink's).
        disable_nagle_algorithm = True

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            now = time.time()
            latencies.extend(now - e["time"] for e in body["events"] if e["kind"] == "metrics")
            last[0] = max([last[0], *(e["seq"] for e in body["events"])])
            answer = json.dumps({"last_seq": last[0]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's signature
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ingest)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="fathom-bench-uplink-"))
    try:
        agent = start_agent(f"http://127.0.0.1:{server.server_address[1]}", 0, "t", rate, seconds, work, path="/events")
        agent.wait(timeout=seconds * 6 + 60)
    finally:
        server.shutdown()
        server.server_close()
    ms = sorted(1000 * x for x in latencies)
    return statistics.median(ms), ms[int(0.99 * (len(ms) - 1))]


# --- rank mode: `python -m bench.live_metrics --spec S --run-dir D`, started by the node agent ---


def rank_main(run_dir: Path) -> None:
    """Writes the points of `RUN_DIR/bench-load.json` to the events file, as rank 0's trainer does."""
    from training.rank_environment import RankEnvironment
    from training.rank_events import EventLog
    from training.run_dir import RunDir

    load = json.loads((run_dir / LOAD_FILE).read_text())
    env = RankEnvironment.from_environ()
    events = EventLog(env.events_file if env else RunDir(run_dir).events_file)
    start = time.monotonic()
    for i in range(load["rate"] * load["seconds"]):
        # Paced against the clock, as steps are: a late write does not lower the rate.
        time.sleep(max(0.0, start + i / load["rate"] - time.monotonic()))
        events.emit("metrics", step=i + 1, loss=1.0, lr=3e-3, grad_norm=1.0, tokens_per_s=1e4, mfu=0.1, step_time=0.1)
    events.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.live_metrics")
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)  # rank mode (started by the agent)
    parser.add_argument("--run-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run_dir is not None:
        rank_main(args.run_dir)
        return
    print(
        "birth in the rank → events file → node agent's uplink → ingest → database → channel layer → websocket; "
        + ", ".join(f"{name}: {rate} points/s for {seconds} s" for name, rate, seconds in LOADS),
        flush=True,
    )
    uplink = {name: uplink_only(rate, seconds) for name, rate, seconds in LOADS}
    for name, (p50, p99) in uplink.items():
        print(f"uplink    {name:<7} birth → a bare ingest endpoint: p50={p50:.1f} ms  p99={p99:.1f} ms", flush=True)
    embedded = run_backend("embedded", {})
    ensure_postgres_database("fathom_bench")
    redis = run_backend(
        "redis",
        {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/fathom_bench", "REDIS_URL": "redis://127.0.0.1:6379/3"},
    )
    worst = {
        key: (max(r[name][0] for name, _, _ in LOADS), max(r[name][1] for name, _, _ in LOADS))
        for key, r in (("embedded", embedded), ("redis", redis))
    }
    print(
        f"clock=wall embedded_p50_ms={worst['embedded'][0]:.1f} embedded_p99_ms={worst['embedded'][1]:.1f} "
        f"redis_p50_ms={worst['redis'][0]:.1f} redis_p99_ms={worst['redis'][1]:.1f} "
        f"embedded_normal_p50_ms={embedded['normal'][0]:.1f} embedded_1000_p50_ms={embedded['1000/s'][0]:.1f} "
        f"redis_normal_p50_ms={redis['normal'][0]:.1f} redis_1000_p50_ms={redis['1000/s'][0]:.1f} "
        f"embedded_1000_p99_ms={embedded['1000/s'][1]:.1f} redis_1000_p99_ms={redis['1000/s'][1]:.1f} "
        f"uplink_normal_p50_ms={uplink['normal'][0]:.1f} uplink_1000_p50_ms={uplink['1000/s'][0]:.1f} "
        f"uplink_1000_p99_ms={uplink['1000/s'][1]:.1f}"
    )


if __name__ == "__main__":
    main()
