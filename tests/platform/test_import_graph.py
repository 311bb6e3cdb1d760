"""The control plane's modules import each other in one direction: no cycle, not even through an
import hidden inside a function. Domain operations queue their tasks by name
(`controlplane.queue`) instead of importing the tasks that call them."""

from __future__ import annotations

import ast
from pathlib import Path

from controlplane.celery import app

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PLATFORM).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every platform module → the platform modules it imports anywhere in its body."""
    files = [p for p in PLATFORM.rglob("*.py") if "migrations" not in p.parts]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from runs import services` imports the module runs.services.
                targets |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
        graph[name] = {t for t in targets if t in modules and t != name and not path.name == "__init__.py"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target, [*path, target])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def test_the_control_planes_modules_import_each_other_without_a_cycle() -> None:
    graph = import_graph()
    assert "runs.tasks" in graph and "runs.services" in graph["runs.tasks"], "the graph sees the imports"
    assert cycles(graph) == []


def test_the_tasks_the_domain_queues_by_name_exist() -> None:
    app.loader.import_default_modules()
    queued = {"runs.tasks.launch_run", "runs.tasks.export_checkpoint", "deployments.tasks.start_deployment",
              "deployments.tasks.stop_deployment"}  # fmt: skip
    assert queued <= set(app.tasks)


def test_no_app_imports_another_apps_views() -> None:
    """Views are entry points: what two apps' views share lives in controlplane (api.py), and
    only the URL root routes to every app's views."""
    crossing = sorted(
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if target.rpartition(".")[2] == "views"
        and target.split(".")[0] != module.split(".")[0]
        and module != "controlplane.urls"
    )
    assert crossing == []


def test_placement_decides_and_claims_while_the_runs_side_records() -> None:
    """hosts.scheduling reaches runs.services and the launch only through the `RunsSide` its
    caller hands it: it records no run event itself."""
    assert import_graph()["hosts.scheduling"] & {"runs.services", "launch.run_agents", "launch.executors"} == set()


def test_settings_import_no_app() -> None:
    """Settings read the environment; each app checks what is its own when Django starts."""
    graph = import_graph()
    assert "controlplane.env" in graph["controlplane.settings"], "the graph sees settings' imports"
    assert {t for t in graph["controlplane.settings"] if t.split(".")[0] != "controlplane"} == set()


def test_no_app_imports_another_apps_private_names() -> None:
    """A name with a leading underscore is its module's own: what two apps share is public."""
    crossing = []
    for path in PLATFORM.rglob("*.py"):
        if "migrations" in path.parts:
            continue
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if (PLATFORM / node.module.split(".")[0]).is_dir() and node.module.split(".")[0] != module.split(".")[0]:
                    crossing += [f"{module} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert crossing == []


def test_runs_and_deployments_never_ask_which_executor_they_have() -> None:
    """They call the executor `launch.executors` gives them; none compares it with one of the
    three (a Slurm-only task may still name SLURM to ask Slurm)."""
    asking = []
    for path in PLATFORM.rglob("*.py"):
        if "migrations" in path.parts or path.parent.name == "launch":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(op, ast.Is | ast.IsNot) for op in node.ops):
                named = [n.attr for n in [node.left, *node.comparators] if isinstance(n, ast.Attribute)]
                if set(named) & {"LOCAL", "HOSTS", "SLURM"}:
                    asking.append(f"{_module_name(path)}:{node.lineno}")
    assert asking == []
    assert "hosts.capacity" not in {t for m, ts in import_graph().items() if m.startswith("deployments.") for t in ts}
