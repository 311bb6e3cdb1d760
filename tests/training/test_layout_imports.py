"""The import table of docs/ARCHITECTURE.md holds: each process's code takes from the others only
what the table allows (imports inside functions included)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def imports_of(folder: Path) -> dict[str, set[str]]:
    """Every module under `folder` → the dotted names it imports, anywhere in its body."""
    found: dict[str, set[str]] = {}
    for path in folder.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        found[str(path.relative_to(REPO))] = names
    return found


def offending(folder: str, allowed: tuple[str, ...], watched: tuple[str, ...]) -> dict[str, list[str]]:
    """Imports of a `watched` package by modules under `folder` that `allowed` does not cover."""
    wrong = {}
    for module, names in imports_of(REPO / folder).items():
        bad = sorted(
            n for n in names
            if n.split(".")[0] in watched and not any(n == a or n.startswith(a + ".") for a in allowed)
        )  # fmt: skip
        if bad:
            wrong[module] = bad
    return wrong


def test_the_ranks_code_never_imports_the_agent_or_the_planner() -> None:
    rank_side = {
        module: sorted(n for n in names if n.startswith(("training.agent", "training.planner")))
        for module, names in imports_of(REPO / "training").items()
        if not module.startswith(("training/agent/", "training/planner/")) and module != "training/plan.py"
    }
    assert {m: n for m, n in rank_side.items() if n} == {}


def test_the_agent_takes_from_the_root_only_the_contracts_it_shares_with_the_ranks() -> None:
    shared = (
        "training.agent", "training.config", "training.run_dir", "training.rank_environment", "training.heartbeat",
        # Torch-free: where the run's checkpoints are, read as the checkpointer reads them.
        "training.checkpoint_storage", "training.storage",
        "training.ports",  # the rendezvous port of a one-node run started by hand
    )  # fmt: skip
    assert offending("training/agent", shared, ("training",)) == {}


def test_the_planner_takes_only_the_config_and_the_flop_count() -> None:
    allowed = ("training.planner", "training.config", "training.metrics")
    assert offending("training/planner", allowed, ("training",)) == {}


def test_the_control_plane_takes_from_training_only_the_config_the_planner_the_run_folder_storage_and_the_export_config() -> None:
    allowed = (
        "training.config", "training.planner", "training.run_dir", "training.hf_format",
        "training.storage", "training.checkpoint_storage",
        # Torch-free: a pretrained folder's model, checked at registration and resolved at submit.
        "training.pretrained",
        # Stdlib only: the rendezvous port of a run on this machine; the base of every field error.
        "training.ports", "training.field_error",
    )  # fmt: skip
    assert offending("platform", allowed, ("training",)) == {}


def test_training_knows_nothing_of_serving_and_serving_takes_from_training_only_the_port_rule_and_field_errors() -> None:
    assert offending("training", (), ("serving", "django", "platform", "controlplane")) == {}
    # Stdlib only: replica ports are picked by the rule rendezvous ports are (one range each), and
    # a replica option's error is a field error as a spec's is.
    allowed = ("training.ports", "training.field_error")
    assert offending("serving", allowed, ("training", "django", "platform", "controlplane")) == {}


def test_the_host_worker_imports_no_part_of_fathom_and_no_django() -> None:
    # It runs on GPU hosts that have neither a database nor Django settings, and starts the
    # node agent and the replica supervisor by module.
    parts = ("django", "platform", "controlplane", "runs", "deployments", "hosts", "training", "serving")
    assert offending("hostworker", (), parts) == {}


def test_of_the_host_worker_the_agent_and_the_supervisor_take_only_the_shipper_and_what_it_tells_them() -> None:
    # Both ship a folder a host keeps to itself by one append protocol (hostworker.shipper), and
    # read what the host worker tells what it starts in one place (hostworker.started_environment);
    # the ranks' code hears from its agent alone, and nothing else of the host worker (celery) is theirs.
    shared = ("hostworker.shipper", "hostworker.started_environment")
    wrong = offending("training", (), ("hostworker",))
    assert {m: n for m, n in wrong.items() if not m.startswith("training/agent/")} == {}
    assert offending("training/agent", shared, ("hostworker",)) == {}
    assert offending("serving", shared, ("hostworker",)) == {}


@pytest.mark.parametrize("module", ["hostworker/shipper.py", "hostworker/started_environment.py"])
def test_what_the_agent_and_the_supervisor_take_of_the_host_worker_is_standard_library_only(module: str) -> None:
    # Imported by the node agent and the supervisor, which have neither celery nor each other's
    # dependencies, and it must not start the host worker's app by importing it.
    names = imports_of(REPO / "hostworker")[module]
    assert sorted(n for n in names if n.split(".")[0] not in sys.stdlib_module_names) == []


def test_each_variable_fathom_passes_to_what_it_starts_is_read_in_one_place() -> None:
    """FATHOM_* variables are read by settings (the control plane), hostworker/config.py (the host
    worker), hostworker/started_environment.py (what it starts) and training/rank_environment.py
    (the ranks), and nowhere else in the product."""
    readers = {"platform/controlplane/settings.py", "platform/controlplane/env.py", "hostworker/config.py",
               "hostworker/started_environment.py", "training/rank_environment.py"}  # fmt: skip
    reading = []
    for folder in ("training", "serving", "hostworker", "platform"):
        for path in (REPO / folder).rglob("*.py"):
            module = str(path.relative_to(REPO))
            if module in readers or "migrations" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "getenv"):
                    if node.args and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("FATHOM_"):
                        reading.append(f"{module}: {node.args[0].value}")
                elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                    if str(node.slice.value).startswith("FATHOM_") and isinstance(node.ctx, ast.Load):
                        reading.append(f"{module}: {node.slice.value}")
    assert reading == []
