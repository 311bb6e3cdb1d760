"""`make run`: Fathom on one machine with no external service.

Migrates the SQLite database, creates (once) and prints the admin login, then runs the web
process (uvicorn: HTTP + websockets), a Celery worker, Celery beat and one host worker for this
machine (`python -m hostworker`, joined with a join token kept in the data folder) until Ctrl-C. Unless
FATHOM_DEMO=0, it also launches the demo training run and, when that succeeds, deploys its
final checkpoint to a vLLM replica and prints how to chat with it.

Ctrl-C stops what it started: every run is cancelled (its last checkpoint kept) and every
deployment stopped (`manage.py stop_work`) while the worker and host worker still run to do it,
then the processes go. The processes are in process groups of their own, so the terminal's
Ctrl-C reaches only this one, which decides the order. A second Ctrl-C skips the waiting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "platform"))

from controlplane.env import env_secret  # noqa: E402
from controlplane.web import web_command  # noqa: E402

PORT = int(os.environ.get("FATHOM_PORT", "8000"))
URL = f"http://127.0.0.1:{PORT}"


def manage(*args: str) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.strip()


def start(name: str, command: list[str], env: dict[str, str], cwd: Path = REPO / "platform") -> subprocess.Popen:
    data_dir = Path(env.get("FATHOM_DATA_DIR", REPO / "var"))
    (data_dir / "logs").mkdir(parents=True, exist_ok=True)
    log = (data_dir / "logs" / f"{name}.log").open("ab")
    print(f"  {name:<7} logs to {log.name}")
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)


def wait_for_web(process: subprocess.Popen) -> None:
    for _ in range(300):
        if process.poll() is not None:
            sys.exit(f"the web process exited with {process.returncode}; see its log")
        try:
            httpx.get(f"{URL}/login/", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    sys.exit("the web process did not answer within a minute")


def wait_for_host(process: subprocess.Popen, log: Path, name: str) -> None:
    """Runs launched before the local host joined would start beside it, not on it."""
    for _ in range(300):
        if process.poll() is not None:
            sys.exit(f"the host worker exited with {process.returncode}; see {log}")
        if f"host {name} joined" in log.read_text(errors="replace"):
            return
        time.sleep(0.2)
    sys.exit(f"the host worker did not join within a minute; see {log}")


def main() -> None:
    data_dir = Path(os.environ.get("FATHOM_DATA_DIR", REPO / "var"))
    data_dir.mkdir(parents=True, exist_ok=True)
    # The cluster's join token: the one set, or one made once and kept in the data folder.
    join_token = env_secret("FATHOM_JOIN_TOKEN", data_dir / "join_token")
    env = dict(os.environ, FATHOM_PUBLIC_URL=URL, PYTHONUNBUFFERED="1", FATHOM_JOIN_TOKEN=join_token)
    # This machine's host worker offers CPU slots (at least 8, so the demo and small multi-node
    # runs fit on one machine as they always did; FATHOM_HOST_CPU_SLOTS sets another count).
    host_name = os.environ.get("FATHOM_HOST_NAME", "local")
    host_env = dict(
        env, FATHOM_HOST_NAME=host_name, FATHOM_HOST_ADDRESS="127.0.0.1",
        FATHOM_HOST_CPU_SLOTS=os.environ.get("FATHOM_HOST_CPU_SLOTS", str(max(8, os.cpu_count() or 1))),
    )  # fmt: skip
    manage("migrate", "--no-input", "-v", "0")
    login = manage("ensure_login")
    print("Starting Fathom on the embedded default (SQLite, filesystem broker, in-memory channels):")
    processes = [
        start("web", web_command(PORT, access_log=True), env),
        start(
            "worker",
            [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "--loglevel=INFO", "--concurrency=2"],
            env,
        ),
        start("beat", [sys.executable, "-m", "celery", "-A", "controlplane", "beat", "--loglevel=INFO"], env),
    ]
    wait_for_web(processes[0])
    processes.append(start("host", [sys.executable, "-m", "hostworker"], host_env, cwd=REPO))
    wait_for_host(processes[-1], data_dir / "logs" / "host.log", host_name)
    print(f"\nFathom is up at {URL}/\n  {login}\n  API docs: {URL}/api/docs/\nPress Ctrl-C to stop.")
    if os.environ.get("FATHOM_DEMO", "1") != "0":
        from tools.demo import run_demo

        run_demo(URL, login)

    def shutdown(*_: object) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C skips the wait
        if all(process.poll() is None for process in processes):
            print("\nStopping every run and deployment (Ctrl-C again to skip) ...", flush=True)
            try:
                print(manage("stop_work", "--wait", "90"), flush=True)
            except (KeyboardInterrupt, subprocess.CalledProcessError):
                print(
                    "Not waited for: runs and deployments that were active keep running; start Fathom "
                    "again and stop them, or end their processes (pgrep -af 'training.agent|serving.supervisor').",
                    flush=True,
                )
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        sys.exit(0)

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    while True:
        for process in processes:
            if process.poll() is not None:
                print(f"{process.args[2]} exited with {process.returncode}; stopping", file=sys.stderr)
                shutdown()
        time.sleep(1)


if __name__ == "__main__":
    main()
