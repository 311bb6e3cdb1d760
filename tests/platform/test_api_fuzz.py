"""The REST API fuzzed against its own OpenAPI schema by schemathesis, through a real web process.

Every check and every phase (coverage, fuzzing, stateful), as a real user's token sees the API:
no answer may be a server error, and every answer must be one the schema documents, in the shape
it documents. The exclusions, with their reasons, are in schemathesis.toml beside this file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rest_framework.authtoken.models import Token

from deployments.models import ApiKey, Deployment
from runs.models import Checkpoint, Run
from tests.platform.conftest import WebServer, free_port, serving

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CONFIG = Path(__file__).with_name("schemathesis.toml")
# A sitecustomize that keeps the web process's name lookups on the machine: the webhooks
# schemathesis creates name random hosts, which are resolved when they are saved.
OFFLINE = Path(__file__).with_name("offline")
# A fixed seed makes a failure in CI reproducible with the same command; examples per operation
# keep the whole run near two minutes on two cores.
SEED = 20261201
EXAMPLES = 20


def give_alice_some_of_everything(alice) -> None:
    """Objects for the detail operations to find: without them nearly every id answers 404."""
    for status in ("queued", "running", "succeeded", "failed"):
        run = Run.objects.create(owner=alice, name=f"a {status} run", spec={}, status=status)
        checkpoint = Checkpoint.objects.create(run=run, step=10, path=str(run.folder / "checkpoints" / "step_10"))
    deployment = Deployment.objects.create(owner=alice, name="d", checkpoint=checkpoint, served_model_name="m", status="stopped")
    ApiKey.issue(deployment)


@pytest.fixture
def offline_web(transactional_db, tmp_path) -> Iterator[WebServer]:
    """`live_web` whose process asks no DNS server (its name lookups fail, numeric ones aside)."""
    path = os.pathsep.join(p for p in (str(OFFLINE), os.environ.get("PYTHONPATH", "")) if p)
    with serving(WebServer(free_port(), tmp_path / "web.log", env={"PYTHONPATH": path})) as server:
        yield server


def test_the_api_answers_every_generated_request_as_its_schema_says(alice, offline_web):
    give_alice_some_of_everything(alice)
    token = Token.objects.get_or_create(user=alice)[0].key
    result = subprocess.run(
        [
            sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "--no-color",
            "run", f"{offline_web.url}/api/schema/",
            "--header", f"Authorization: Token {token}",
            "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--workers", "1",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    report = result.stdout + result.stderr
    print(report[-3000:])  # schemathesis' summary, for `pytest -s`
    # By name, the two promises of issue 31: no server error, and no answer outside its schema.
    for failure in ("Server error", "Response violates schema", "Undocumented Content-Type"):
        assert failure not in report, f"{failure}:\n{report[-20000:]}"
    assert result.returncode == 0, report[-20000:]
    selected = re.search(r"Operations:\s+(\d+) selected / (\d+) total", report)
    assert selected and selected.group(1) == selected.group(2), report[-5000:]
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert re.search(rf"✅\s+{phase}", report), f"{phase} did not pass:\n{report[-5000:]}"
    assert re.search(r"\d+ generated, \d+ passed", report), report[-5000:]
