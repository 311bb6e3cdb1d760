"""Point-to-websocket latency of live metrics at 1,000 points/s, through the real ingest path.

For each backend (the embedded default: SQLite + in-memory channel layer; and PostgreSQL +
Redis), a real web process (uvicorn, as `make run` starts it) serves the control plane. One websocket client follows a run,
while a sender posts metrics to `POST /api/runs/<id>/events/` as a node agent's reporter does:
batches of BATCH points every BATCH ms, i.e. 1,000 points/s. Each point carries its send time;
latency is websocket receipt minus send time (same clock, same machine).

    python -m bench.live_metrics            # ends with one key=value summary line
"""

from __future__ import annotations

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

import httpx
import websockets

REPO = Path(__file__).resolve().parents[1]
POINTS_PER_SECOND = 1000
BATCH = 50  # points per POST: a reporter shipping every 50 ms
SECONDS = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


SETUP = """
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from runs.models import Run
from runs.services import hash_token
user, _ = get_user_model().objects.get_or_create(username="bench")
run = Run.objects.create(owner=user, name="bench", spec={}, status="running", token_hash=hash_token("bench-agent"))
print(run.pk, Token.objects.get_or_create(user=user)[0].key)
"""


def ensure_postgres_database(name: str) -> None:
    import psycopg

    with psycopg.connect("postgresql://postgres@127.0.0.1:5432/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name}")
        conn.execute(f"CREATE DATABASE {name}")


async def measure(url: str, run_id: int, user_token: str) -> list[float]:
    latencies: list[float] = []
    expected = POINTS_PER_SECOND * SECONDS
    ws_url = url.replace("http", "ws") + f"/ws/runs/{run_id}/?after=0"
    async with websockets.connect(ws_url, additional_headers={"Authorization": f"Token {user_token}"}, origin=url) as ws:

        async def receive() -> None:
            while len(latencies) < expected:
                message = json.loads(await ws.recv())
                now = time.time()
                latencies.extend(now - e["sent_at"] for e in message["events"] if e["kind"] == "metrics")

        async def send() -> None:
            headers = {"Authorization": "Bearer bench-agent"}
            async with httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as client:
                seq = 0
                start = time.monotonic()
                for tick in range(expected // BATCH):
                    # Paced against the clock, so a slow POST does not lower the offered rate.
                    await asyncio.sleep(max(0.0, start + tick * BATCH / POINTS_PER_SECOND - time.monotonic()))
                    now = time.time()
                    events = []
                    for _ in range(BATCH):
                        seq += 1
                        events.append({"seq": seq, "kind": "metrics", "time": now, "data": {"step": seq, "loss": 1.0, "sent_at": now}})
                    response = await client.post(f"/api/runs/{run_id}/events/", json={"source": "node-0", "events": events})
                    response.raise_for_status()

        await asyncio.wait_for(asyncio.gather(receive(), send()), timeout=SECONDS * 6)
    return latencies


def run_backend(name: str, extra_env: dict[str, str]) -> tuple[float, float, float]:
    data_dir = tempfile.mkdtemp(prefix=f"fathom-bench-{name}-")
    env = dict(os.environ, FATHOM_DATA_DIR=data_dir, OMP_NUM_THREADS="1", LOG_LEVEL="WARNING", **extra_env)
    manage = [sys.executable, str(REPO / "manage.py")]
    subprocess.run([*manage, "migrate", "-v", "0"], env=env, check=True)
    run_id, token = subprocess.run(
        [*manage, "shell", "-c", SETUP], env=env, check=True, capture_output=True, text=True
    ).stdout.split()[-2:]
    sys.path.insert(0, str(REPO / "platform"))
    from controlplane.web import web_command

    port = free_port()
    server = subprocess.Popen(
        web_command(port),
        cwd=REPO / "platform", env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                httpx.get(f"{url}/login/", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        started = time.monotonic()
        latencies = asyncio.run(measure(url, int(run_id), token))
        elapsed = time.monotonic() - started
    finally:
        server.terminate()
        server.wait(timeout=20)
    ms = sorted(1000 * x for x in latencies)
    p50 = statistics.median(ms)
    p99 = ms[int(0.99 * (len(ms) - 1))]
    rate = len(ms) / elapsed
    print(f"{name:<9} points={len(ms)} rate={rate:.0f}/s  p50={p50:.1f} ms  p99={p99:.1f} ms")
    return p50, p99, rate


def main() -> None:
    print(f"{POINTS_PER_SECOND} points/s in batches of {BATCH} for {SECONDS} s, ingest → database → websocket")
    embedded = run_backend("embedded", {})
    ensure_postgres_database("fathom_bench")
    redis = run_backend(
        "redis", {"DATABASE_URL": "postgres://postgres@127.0.0.1:5432/fathom_bench", "REDIS_URL": "redis://127.0.0.1:6379/3"}
    )
    print(
        f"embedded_p50_ms={embedded[0]:.1f} embedded_p99_ms={embedded[1]:.1f} embedded_points_s={embedded[2]:.0f} "
        f"redis_p50_ms={redis[0]:.1f} redis_p99_ms={redis[1]:.1f} redis_points_s={redis[2]:.0f}"
    )


if __name__ == "__main__":
    main()
