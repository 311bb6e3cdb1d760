"""`pytest --timings=FILE`: each test's wall time (setup + call + teardown), outcome, markers and
what it starts, one JSON object a line, for `python -m tools.test_timings FILE` to group.

What a test starts is read off the fixtures it asks for (and its markers): the expensive things a
test can start are all fixtures or markers here, so the grouping needs no list of test names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

# What a test starts, the most expensive first: a test counts under the first it uses.
STARTS: tuple[tuple[str, frozenset[str]], ...] = (
    ("namespace hosts", frozenset({"network", "cluster", "running_cluster", "s3_on_bridge", "netns_hosts"})),
    ("Slurm", frozenset({"slurm", "slurm_cluster"})),
    ("browser", frozenset({"browser", "browser_page"})),
    ("vLLM replicas", frozenset({"vllm_python", "quantize_python", "mark:vllm"})),
    ("web/worker stack", frozenset({"live_web", "celery_worker", "celery_worker_with_beat"})),
    ("S3", frozenset({"s3", "s3_server"})),
    ("torchrun ranks", frozenset({"agents", "ingest", "trained", "mark:slow"})),
)


def starts_of(fixtures: set[str], markers: set[str]) -> str:
    wanted = fixtures | {f"mark:{m}" for m in markers}
    return next((name for name, names in STARTS if wanted & names), "in-process")


class TimingsRecorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> None:
        markers = {m.name for m in item.iter_markers()} & {"slow", "vllm", "browser", "services"}
        fixtures = set(getattr(item, "fixturenames", ()))
        self.tests[item.nodeid] = {
            "test": item.nodeid, "file": item.nodeid.split("::", 1)[0], "seconds": 0.0, "outcome": "passed",
            "markers": sorted(markers), "starts": starts_of(fixtures, markers),
        }  # fmt: skip

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        test = self.tests.get(report.nodeid)
        if test is None:
            return
        test["seconds"] += report.duration
        if report.outcome != "passed" and test["outcome"] == "passed":
            test["outcome"] = report.outcome

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as out:
            for test in self.tests.values():
                out.write(json.dumps(test) + "\n")
