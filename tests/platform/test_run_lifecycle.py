"""A run created through the REST API trains for real and is followed live over a websocket.

Real processes throughout: the web process (uvicorn: HTTP + websockets), a Celery worker on the configured broker,
node agents under torchrun machinery, gloo ranks. Nothing is faked.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import websockets
from rest_framework.authtoken.models import Token

from runs.models import Run
from runs.tasks import LAUNCH_GRACE, reconcile_runs
from tests.platform.conftest import REPO, process_env

# The whole control plane's path, on PostgreSQL + Redis in make test-services only: the embedded
# default's web and worker processes are the e2e pages' and test_serving_e2e's, so running these
# on it too (four minutes of ranks and processes) would show nothing new.
# Each test starts its own web process and worker: both workers take them.
pytestmark = [pytest.mark.slow, pytest.mark.services, pytest.mark.spread]

STORY = "\n".join(
    f"{name} walked to the {place} and counted {n} {thing} before the rain."
    for n, (name, place, thing) in enumerate(
        [(a, b, c) for a in ("Ada", "Bruno", "Chiara", "Dmitri") for b in ("harbour", "mill", "library") for c in ("pears", "kites", "lanterns")]
    )
)


def api(server, user) -> httpx.Client:
    token = Token.objects.get_or_create(user=user)[0].key
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Token {token}"}, timeout=30)


async def follow(
    server, token: str, run_id: int, after: int = 0, until: str = "succeeded", timeout: float = 400, log_lines: list | None = None
) -> list[dict]:
    """Every event of the run over the websocket, in order, until the `until` event arrives."""
    url = server.url.replace("http", "ws") + f"/ws/runs/{run_id}/?after={after}"
    events: list[dict] = []
    async with websockets.connect(url, additional_headers={"Authorization": f"Token {token}"}, origin=server.url) as ws:
        async with asyncio.timeout(timeout):
            while not any(e["kind"] == until for e in events):
                message = json.loads(await ws.recv())
                if message["type"] == "logs" and log_lines is not None:
                    log_lines.extend(message["lines"])
                elif message["type"] == "events":
                    events.extend(message["events"])
    return events


def run_folder(run_id: int) -> Path:
    return Run.objects.get(pk=run_id).folder


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.mark.django_db(transaction=True)
def test_a_two_rank_run_trains_streams_live_and_is_exported(alice, live_web, celery_worker):
    client = api(live_web, alice)
    dataset = client.post("/api/datasets/", files={"file": ("stories.txt", STORY.encode())}).json()
    spec = {"layout": {"dp": 2}, "train": {"steps": 8, "checkpoint_interval": 4, "global_batch": 4}}
    created = client.post("/api/runs/", json={"name": "live", "recipe": "tiny", "dataset": dataset["id"], "spec": spec})
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]

    streamed_log: list[str] = []
    events = asyncio.run(follow(live_web, Token.objects.get(user=alice).key, run_id, log_lines=streamed_log))

    assert [e["seq"] for e in events] == list(range(1, len(events) + 1))  # no gap, no repeat
    metrics = [e for e in events if e["kind"] == "metrics"]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m["loss"] > 0 and m["tokens_per_s"] > 0 for m in metrics)
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [4, 8]

    run = client.get(f"/api/runs/{run_id}/").json()
    assert (run["status"], run["step"]) == ("succeeded", 8)
    wait_until(lambda: client.get(f"/api/runs/{run_id}/checkpoints/").json()[-1]["export_path"], 180, "the export")
    checkpoints = client.get(f"/api/runs/{run_id}/checkpoints/").json()
    assert [c["step"] for c in checkpoints] == [4, 8]
    export = Path(checkpoints[-1]["export_path"])
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {p.name for p in export.iterdir()}
    assert json.loads((export / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    log_tail = client.get(f"/api/runs/{run_id}/logs/?rank=0").json()["lines"]
    assert log_tail
    assert streamed_log and set(streamed_log) <= set(Path(run_folder(run_id), "logs", "rank0.log").read_text().splitlines())


@pytest.mark.django_db(transaction=True)
def test_a_two_node_run_meets_at_a_rendezvous_store_of_its_own(alice, live_web, celery_worker):
    client = api(live_web, alice)
    spec = {
        "layout": {"dp": 2},
        "nodes": {"min": 2, "max": 2, "nproc_per_node": 1},
        "train": {"steps": 4, "warmup_steps": 2, "checkpoint_interval": 2},
    }
    run_id = client.post("/api/runs/", json={"name": "two nodes", "spec": spec}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=run_id).status == "succeeded", 300, "the run to succeed")
    run = Run.objects.get(pk=run_id)
    rendezvous = list(run.events.filter(kind="rendezvous").values_list("data", flat=True))
    assert sorted(r["node"] for r in rendezvous) == [0, 1] and {r["nodes"] for r in rendezvous} == {2}
    # The agents were told not to host the store (--host-store no), so they met at the one the
    # launcher started beside them.
    assert "rendezvous store listening on 127.0.0.1:" in (run.folder / "logs" / "rendezvous-store.log").read_text()
    assert list(run.events.filter(kind="metrics").values_list("data__step", flat=True)) == [1, 2, 3, 4]


@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_right_after_claiming_a_launch_still_starts_exactly_one_run(alice, live_web, celery_worker):
    client = api(live_web, alice)
    spec = {"train": {"steps": 6, "warmup_steps": 2, "checkpoint_interval": 3}}
    run_id = client.post("/api/runs/", json={"name": "claimed", "spec": spec}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=run_id).status != "queued", 120, "the claim")
    celery_worker.kill()  # SIGKILL, right after the claim: the launch may be half done
    celery_worker.start()
    # The reconcile task (beat sends it every few seconds in production) re-sends a lost launch.
    time.sleep(LAUNCH_GRACE.total_seconds() + 1)
    reconcile_runs.delay()
    wait_until(lambda: Run.objects.get(pk=run_id).status == "succeeded", 300, "the run to succeed")
    run = Run.objects.get(pk=run_id)
    assert run.events.filter(kind="agent_started").count() == 1  # one agent trained it, never two
    assert list(run.events.filter(kind="metrics").values_list("data__step", flat=True)) == [1, 2, 3, 4, 5, 6]


@pytest.mark.django_db(transaction=True)
def test_restarting_the_web_process_mid_run_leaves_no_gap_in_the_history(alice, live_web, celery_worker):
    client = api(live_web, alice)
    spec = {"train": {"steps": 30, "checkpoint_interval": 10}}
    run_id = client.post("/api/runs/", json={"name": "web restart", "spec": spec}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=run_id).step >= 3, 300, "a few steps")
    live_web.process.send_signal(signal.SIGKILL)
    live_web.process.wait()
    time.sleep(3)  # the agent's reporter spools while the control plane is away
    live_web.start()
    client = api(live_web, alice)
    wait_until(lambda: client.get(f"/api/runs/{run_id}/").json()["status"] == "succeeded", 300, "the run to succeed")
    history = client.get(f"/api/runs/{run_id}/events/").json()
    assert [e["seq"] for e in history] == list(range(1, len(history) + 1))
    assert [e["data"]["step"] for e in history if e["kind"] == "metrics"] == list(range(1, 31))


@pytest.mark.django_db(transaction=True)
def test_the_cli_creates_watches_and_reports_a_run(alice, live_web, celery_worker, tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"train": {"steps": 6, "warmup_steps": 2, "checkpoint_interval": 3}}))
    out = subprocess.run(
        [sys.executable, "manage.py", "fathom", "runs", "create", "--spec", str(spec), "--user", "alice", "--watch"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=400,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "queued" in out.stdout
    assert "succeeded" in out.stdout.splitlines()[-1]
    assert "6/6" in out.stderr  # tqdm's progress bar reached the last step


def test_the_cli_names_the_bad_field(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"layout": {"tp": 3}}))
    out = subprocess.run(
        [sys.executable, "manage.py", "fathom", "runs", "create", "--spec", str(spec), "--user", "nobody"],
        cwd=REPO, env=process_env(), capture_output=True, text=True, timeout=120,
    )
    assert out.returncode != 0
    assert "--user: no user named 'nobody'" in out.stderr


@pytest.mark.django_db(transaction=True)
def test_a_cancelled_run_keeps_its_checkpoint_and_resumes_from_it(alice, live_web, celery_worker):
    client = api(live_web, alice)
    spec = {"train": {"steps": 40, "warmup_steps": 2, "checkpoint_interval": 5}}
    run_id = client.post("/api/runs/", json={"name": "paused", "spec": spec}).json()["id"]
    wait_until(lambda: Run.objects.get(pk=run_id).step >= 12, 300, "a dozen steps")
    assert client.post(f"/api/runs/{run_id}/cancel/").json()["cancel_requested"] is True
    wait_until(lambda: Run.objects.get(pk=run_id).status == "cancelled", 120, "the cancel")
    kept = [c["step"] for c in client.get(f"/api/runs/{run_id}/checkpoints/").json()]
    assert kept and kept[-1] >= 10
    assert client.post(f"/api/runs/{run_id}/resume/").json()["status"] == "queued"
    wait_until(lambda: Run.objects.get(pk=run_id).status == "succeeded", 300, "the resumed run to finish")
    run = Run.objects.get(pk=run_id)
    resumed = run.events.filter(kind="resumed").values_list("data__step", flat=True)
    assert list(resumed)[-1] >= kept[-1]  # it went on from a checkpoint, not from scratch
    steps = list(run.events.filter(kind="metrics").values_list("data__step", flat=True))
    assert steps[-1] == 40 and set(range(1, 41)) <= set(steps)


@pytest.mark.django_db(transaction=True)
def test_a_run_trains_with_the_tokenizer_of_an_earlier_run_of_its_owner(alice, live_web, celery_worker):
    client = api(live_web, alice)
    dataset = client.post("/api/datasets/", files={"file": ("stories.txt", STORY.encode())}).json()
    spec = {"train": {"steps": 2, "warmup_steps": 1, "checkpoint_interval": 2}}
    first = client.post("/api/runs/", json={"name": "first", "dataset": dataset["id"], "spec": spec}).json()
    wait_until(lambda: Run.objects.get(pk=first["id"]).status == "succeeded", 300, "the first run")

    # The second run trains on the demo corpus, so a tokenizer of its own would differ.
    created = client.post("/api/runs/", json={"name": "second", "tokenizer_run": first["id"], "spec": spec})
    assert created.status_code == 201, created.text
    second = created.json()
    wait_until(lambda: Run.objects.get(pk=second["id"]).status == "succeeded", 300, "the second run")

    given = (Run.objects.get(pk=first["id"]).tokenizer_dir / "tokenizer.json").read_bytes()
    used = (Run.objects.get(pk=second["id"]).tokenizer_dir / "tokenizer.json").read_bytes()
    assert used == given
    written = json.loads((run_folder(second["id"]) / "spec.json").read_text())["data"]
    assert written == {
        "dataset": "", "tokenizer": str(Run.objects.get(pk=first["id"]).tokenizer_dir), "storage": "",
        "validation_dataset": "", "validation_fraction": 0.0, "pretrained": "",
    }  # fmt: skip
