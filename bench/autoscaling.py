"""A deployment that sleeps at zero and scales with its load, through the real control plane.

    python -m bench.autoscaling [--clients 96] [--tokens 256] [--idle-s 10]

The control plane as `make run` runs it (the embedded default: SQLite, the filesystem broker, a
web process and a Celery worker with beat), one deployment of bench.serving's small Llama (CPU,
float32, eager, the product's default `max_num_seqs`) with `autoscaling: {min_replicas: 0,
max_replicas: 2}` and the product's defaults for the rest, except `idle_s`, which only says
when it falls asleep (600 s by default; the bench does not wait that long).

- **Cold start.** Once it is asleep, one streamed chat through `/v1`: held while the deployment
  wakes and its replica starts, then answered. `cold_start_first_token_s` is that request's time
  to its first token. Beside it, in the same run, the bare replica start it stands on: a
  supervisor of the same export launched by hand, to the first token of the same request sent
  straight to its replica (`replica_start_first_token_s`). Its second start is timed, as the
  woken deployment's is its second: the first fills vLLM's caches in the folder.
- **Scale up.** `clients` clients then stream completions of `tokens` tokens through `/v1`, one
  after another each: more than one replica batches (`max_num_seqs` 64), so requests wait.
  `scale_up_s` runs from the load's start to the second replica ready, `scale_decision_s` to
  the autoscaler's `scaled` event (its `window_s`, 30 s, is most of it). On a machine of few
  cores the new replica starts on cores the loaded one, the web process and the clients keep
  busy, so its start takes longer than the bare one.

Ends with one `key=value` line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.serving import ROOT, SPEC, _request, _vllm_python, _wait
from bench.stream_client import stream
from bench.waiting import free_port
from serving.deployment_config import DeploymentConfig
from serving.state import read_state
from serving.supervisor import launch_detached, request_stop
from serving.vllm import ReplicaOptions
from tools.tiny_checkpoint import build_tiny_llama

OPTIONS = {"max_model_len": 1024, "kv_cache_gib": 1, "dtype": "float32", "enforce_eager": True}
CHAT = "the cat sees"


def _replica_start_first_token_s(checkpoint: Path, tmp: Path) -> float:
    """A supervisor of `checkpoint` launched by hand, to the first token of one chat sent straight
    to its replica once it answers."""
    config = DeploymentConfig(
        name="bench", export=str(checkpoint), state_dir=str(tmp / "bare"), python=_vllm_python(), replicas=1,
        options=ReplicaOptions(**OPTIONS, cpu_threads_bind="nobind"),  # type: ignore[arg-type]
    )  # fmt: skip
    for _ in range(2):
        started = time.perf_counter()
        supervisor = launch_detached(config)
        try:

            def ready(supervisor: int = supervisor) -> bool:
                state = read_state(config.state_dir)
                return state is not None and state.supervisor_pid == supervisor and state.replicas[0].phase == "ready"

            _wait(ready, 600, "the bare replica")
            state = read_state(config.state_dir)
            assert state is not None and state.replicas[0].url
            url = state.replicas[0].url
            asyncio.run(stream(url, _request(url, CHAT, 8, "", chat=True), chat=True))
            took = time.perf_counter() - started
        finally:
            request_stop(config.state_dir)
            _wait(lambda pid=supervisor: not _alive(pid), 120, "the bare supervisor's exit")
    return took


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)
        os.kill(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        return False
    return True


def _control_plane(data_dir: Path) -> dict[str, str]:
    os.environ["FATHOM_DATA_DIR"] = str(data_dir)
    for name in ("DATABASE_URL", "REDIS_URL"):  # the embedded default, whatever the shell says
        os.environ.pop(name, None)
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    os.environ["FATHOM_VLLM_PYTHON"] = _vllm_python()
    sys.path.insert(0, str(ROOT / "platform"))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "platform")]), "OMP_NUM_THREADS": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=96, help="clients streaming at once in the scale-up load")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--idle-s", type=float, default=10.0, help="idle_s: how soon it first falls asleep")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    cache = Path(os.environ.get("FATHOM_TEST_CACHE", Path.home() / ".cache" / "fathom" / "test-checkpoints"))
    checkpoint = build_tiny_llama(cache / "bench-llama", SPEC)
    tmp = Path(tempfile.mkdtemp(prefix="fathom-bench-autoscaling-"))

    bare = _replica_start_first_token_s(checkpoint, tmp)
    print(f"bare replica: launched to first token in {bare:.1f} s", flush=True)

    env = _control_plane(tmp / "control")
    from django.contrib.auth import get_user_model

    from controlplane.web import web_command
    from deployments import services
    from deployments.models import ApiKey, Deployment
    from runs.models import Checkpoint, Run

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    processes = [
        subprocess.Popen(web_command(port), cwd=ROOT / "platform", env=env, start_new_session=True,
                         stdout=(tmp / "web.log").open("wb"), stderr=subprocess.STDOUT),
        subprocess.Popen([sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-B", "--pool=threads",
                          "--concurrency=4", "--schedule", str(tmp / "beat-schedule"), "--without-gossip",
                          "--without-mingle", "--without-heartbeat"], cwd=ROOT / "platform", env=env,
                         start_new_session=True, stdout=(tmp / "worker.log").open("wb"), stderr=subprocess.STDOUT),
    ]  # fmt: skip
    deployment = None
    try:
        user = get_user_model().objects.create_user("bench")
        run = Run.objects.create(owner=user, name="bench", spec={}, status=Run.Status.SUCCEEDED)
        exported = Checkpoint.objects.create(run=run, step=SPEC.train_steps, path=str(checkpoint), export_path=str(checkpoint))
        deployment = services.do_create_deployment(
            user, exported, name="bench", served_model_name="bench", replicas=1, options=dict(OPTIONS),
            autoscaling={"min_replicas": 0, "max_replicas": 2, "idle_s": args.idle_s},
        )  # fmt: skip
        _, key = ApiKey.issue(deployment)

        def status() -> str:
            return Deployment.objects.values_list("status", flat=True).get(pk=deployment.pk)

        _wait(lambda: status() in ("ready", "failed"), 600, "the deployment")
        _wait(lambda: status() == "asleep", 600, "the deployment asleep")
        print("asleep; one chat wakes it", flush=True)
        cold = asyncio.run(stream(url, _request(url, CHAT, 8, key, chat=True), chat=True)).ttft_s
        print(f"cold start: first token after {cold:.1f} s", flush=True)

        decided_at: list[float] = []
        state_dir = deployment.folder

        async def load() -> tuple[float, float]:
            stop = asyncio.Event()
            started = time.perf_counter()

            async def client(index: int) -> None:
                while not stop.is_set():
                    await stream(url, _request(url, f"{CHAT} {index}", args.tokens, key), chat=False)

            clients = [asyncio.create_task(client(i)) for i in range(args.clients)]
            try:
                while True:
                    await asyncio.sleep(0.5)
                    if not decided_at and await asyncio.to_thread(
                        lambda: Deployment.objects.get(pk=deployment.pk).events.filter(kind="scaled", data__to=2).exists()
                    ):
                        decided_at.append(time.perf_counter() - started)
                    state = read_state(state_dir)
                    if state is not None and sum(r.phase == "ready" for r in state.replicas) == 2:
                        return decided_at[0] if decided_at else float("nan"), time.perf_counter() - started
                    if time.perf_counter() - started > 900:
                        raise TimeoutError("no second replica within 900 s of the load")
            finally:
                stop.set()
                for task in clients:
                    task.cancel()
                await asyncio.gather(*clients, return_exceptions=True)

        decision, scale_up = asyncio.run(load())
        print(
            f"scale up: decided after {decision:.1f} s of load, the second replica ready after {scale_up:.1f} s "
            f"({scale_up - decision:.1f} s to start under the load)", flush=True,
        )  # fmt: skip
        print(
            f"cold_start_first_token_s={cold:.1f} replica_start_first_token_s={bare:.1f} "
            f"cold_over_bare={cold / bare:.2f} scale_decision_s={decision:.1f} scale_up_s={scale_up:.1f}"
        )
    finally:
        if deployment is not None:
            request_stop(deployment.folder)
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)


if __name__ == "__main__":
    main()
