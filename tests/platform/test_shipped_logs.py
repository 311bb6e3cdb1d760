"""A host that keeps a run's folder to itself ships its logs to the control plane: a real
`training.agent.log_shipper.LogShipper` against a real web process. Our copy holds each host's
bytes once, whatever is sent again, and a shipper that shares our folder ships nothing."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import httpx
import pytest

from hosts.models import DeviceClaim, Host
from launch import run_agents
from runs.models import Run
from training.agent.log_shipper import LogShipper, ShipperConfig
from training.run_dir import RunDir


def token_of(url: str, node: int = 0) -> str:
    """Node `node`'s token in the first launch of the run whose shipped-logs `url` this is."""
    return run_agents.node_token(int(url.rstrip("/").split("/")[-2]), 1, node)

UVICORN_KEEP_ALIVE_S = 5  # uvicorn's --timeout-keep-alive default, which the web command keeps


def shipper(url: str, host_run: RunDir, host: str, node: int = 0) -> LogShipper:
    return LogShipper(
        ShipperConfig(
            logs_url=url, run_token=token_of(url, node), logs_dir=host_run.logs_dir, node=host_run.node(node),
            node_rank=node, address=host, poll_interval=0.2,
        )
    )  # fmt: skip


def ship(url: str, host_run: RunDir, host: str) -> LogShipper:
    """One agent's life: start shipping, stop, ship the rest."""
    sent = shipper(url, host_run, host)
    sent.start()
    assert sent.close(timeout=30), sent.last_error
    return sent


def post(url: str, token: str, **piece: object) -> httpx.Response:
    body = {"address": "10.0.0.5", "node": 0, "probe": "none", "file": "rank0.log", "offset": 0, "chunk": "", **piece}
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


@pytest.mark.django_db(transaction=True)
def test_a_hosts_logs_reach_our_copy_once_whatever_is_sent_again(alice, live_web, tmp_path: Path) -> None:
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.RUNNING, token_launch=1)
    url = f"{live_web.url}/api/runs/{run.pk}/shipped-logs/"
    ours = run.run_dir.rank_log(0)
    first = RunDir(tmp_path / "host-a" / "run")
    first.logs_dir.mkdir(parents=True)
    # More than two pieces (256 KiB each), and bytes that are not text.
    first.rank_log(0).write_bytes(b"step 1\n" + bytes(range(256)) * 2100)
    first.agent_log(0).write_text("agent started\n")
    ship(url, first, "10.0.0.5")
    assert ours.read_bytes() == first.rank_log(0).read_bytes()
    assert run.run_dir.agent_log(0).read_text() == "agent started\n"

    # The agent starts again on that host and its ranks append: only the new bytes come.
    with first.rank_log(0).open("ab") as f:
        f.write(b"step 2\n")
    ship(url, first, "10.0.0.5")
    assert ours.read_bytes() == first.rank_log(0).read_bytes()
    # A piece sent again, and a piece past what we hold, change nothing; both answer our end.
    held = len(ours.read_bytes())
    again = post(url, token_of(url), offset=0, chunk=base64.b64encode(first.rank_log(0).read_bytes()[:100]).decode())
    gap = post(url, token_of(url), offset=held + 10, chunk=base64.b64encode(b"lost?").decode())
    assert (again.status_code, again.json(), gap.json()) == (200, {"offset": held}, {"offset": held})
    assert len(ours.read_bytes()) == held

    # One shipper over a pause longer than the web server keeps an idle connection (uvicorn:
    # 5 s): its next piece goes on a new connection, not into an error.
    lasting = shipper(url, first, "10.0.0.5")
    lasting.ship_once()
    time.sleep(UVICORN_KEEP_ALIVE_S + 2)
    with first.rank_log(0).open("ab") as f:
        f.write(b"step 2.5\n")
    lasting.ship_once()
    assert lasting.last_error is None and ours.read_bytes() == first.rank_log(0).read_bytes()

    # The run resumed on another host: its rank 0 log follows the first host's.
    second = RunDir(tmp_path / "host-b" / "run")
    second.logs_dir.mkdir(parents=True)
    second.rank_log(0).write_bytes(b"resumed: step 3\n")
    ship(url, second, "10.0.0.6")
    assert ours.read_bytes() == first.rank_log(0).read_bytes() + b"resumed: step 3\n"
    assert json.loads(run.run_dir.shipped_logs_file.read_text())["10.0.0.6/rank0.log"] == 16

    # Bad pieces are refused, naming why.
    wrong_name = post(url, token_of(url), file="../spec.json")
    assert wrong_name.status_code == 400 and "file" in wrong_name.json()
    assert post(url, token_of(url), chunk="not base64!").json() == {"chunk": ["must be base64"]}
    assert post(url, "not-the-token").status_code == 401
    # Node 0's token speaks for node 0 only.
    assert post(url, token_of(url), node=1).status_code == 401


@pytest.mark.django_db(transaction=True)
def test_an_agent_that_writes_into_our_own_run_folder_ships_nothing(alice, live_web) -> None:
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.RUNNING, token_launch=1)
    run.run_dir.logs_dir.mkdir(parents=True)
    run.run_dir.rank_log(0).write_text("step 1\n")
    sent = ship(f"{live_web.url}/api/runs/{run.pk}/shipped-logs/", run.run_dir, "127.0.0.1")
    assert sent.shared
    assert run.run_dir.rank_log(0).read_text() == "step 1\n"
    assert not run.run_dir.shipped_logs_file.exists()


@pytest.mark.django_db
def test_a_placed_nodes_logs_are_taken_only_as_its_hosts(alice, client) -> None:
    run = Run.objects.create(owner=alice, name="r", spec={}, status=Run.Status.RUNNING, token_launch=1)
    host = Host.objects.create(name="a", address="10.0.0.5", devices=[{"index": 0, "kind": "cpu"}])
    DeviceClaim.objects.create(host=host, device=0, run=run, node=0)
    url = f"/api/runs/{run.pk}/shipped-logs/"
    body = {"address": "10.0.0.6", "node": 0, "probe": "none", "file": "rank0.log", "offset": 0, "chunk": ""}
    auth = {"HTTP_AUTHORIZATION": f"Bearer {token_of(url)}"}
    elsewhere = client.post(url, body, content_type="application/json", **auth)
    assert elsewhere.status_code == 403
    assert elsewhere.json() == {"detail": "address: node 0 runs on 10.0.0.5; got '10.0.0.6'"}
    assert client.post(url, {**body, "address": "10.0.0.5"}, content_type="application/json", **auth).json() == {"offset": 0}
