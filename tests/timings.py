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


def what_it_starts(item: pytest.Item) -> tuple[str, list[str]]:
    """What `item` starts and which of the suite's markers it has."""
    markers = {m.name for m in item.iter_markers()} & {"slow", "vllm", "browser", "services"}
    return starts_of(set(getattr(item, "fixturenames", ())), markers), sorted(markers)


class TimingsRecorder:
    """Registered where the reports arrive: in the one pytest process, or in pytest-xdist's
    controller, whose workers send each report with what its test starts (`user_properties`)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        said = dict(report.user_properties)
        if "starts" not in said:
            return
        test = self.tests.setdefault(report.nodeid, {
            "test": report.nodeid, "file": report.nodeid.split("::", 1)[0], "seconds": 0.0, "outcome": "passed",
            "markers": said["markers"], "starts": said["starts"],
        })  # fmt: skip
        test["seconds"] += report.duration
        if report.outcome != "passed" and test["outcome"] == "passed":
            test["outcome"] = report.outcome

    def pytest_sessionfinish(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w") as out:
            for test in self.tests.values():
                out.write(json.dumps(test) + "\n")
