"""Every collective in training/ gets a tensor its group can carry on a GPU host.

Under NCCL a CPU tensor has no backend, and the run fails at the collective, not before: on a
resume, at the first automatic checkpoint interval. On CPU hosts every tensor is a CPU tensor,
so no run here shows it; reading the code does. `tensors_made_without_a_device` follows the
tensor each `dist.<collective>` call gets back through the assignments of its function (and of
its module, for an attribute) to where it was made, and reports a tensor factory called without
`device=`. Tensors derived from others (a gradient, `x.pow(2)`, `torch.stack` of such) have
their sources' device. training/collectives.py, whose `agreed` makes its tensor on the device
it is given, is what the rest of training/ calls for a small agreement.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[2] / "training"

COLLECTIVES = {
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv",
    "isend", "irecv",
}  # fmt: skip
# torch's functions that make a tensor from nothing: on the CPU unless given a device.
FACTORIES = {
    "tensor", "as_tensor", "zeros", "ones", "full", "empty", "arange", "linspace", "eye", "rand", "randn", "randint",
}  # fmt: skip


@dataclass(frozen=True)
class Finding:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


class _Module:
    """One file's assignments: by function and name, and by attribute name over the whole file."""

    def __init__(self, tree: ast.Module) -> None:
        self.attributes: dict[str, list[ast.expr]] = {}
        for node in ast.walk(tree):
            for target, value in _assignments(node):
                if isinstance(target, ast.Attribute):
                    self.attributes.setdefault(target.attr, []).append(value)
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                self.attributes.setdefault(node.target.id, []).append(node.value)  # a dataclass field

    def problems(
        self, value: ast.expr, function: ast.FunctionDef | ast.AsyncFunctionDef, before: int, seen: set[int]
    ) -> list[tuple[int, str]]:
        """Where the tensor `value` (in `function`, at line `before`) or what it is made of was
        made without a device."""
        if id(value) in seen:
            return []
        seen.add(id(value))
        if isinstance(value, ast.Call):
            name = _torch_function(value.func)
            if name in FACTORIES and not any(k.arg == "device" for k in value.keywords):
                return [(value.lineno, f"torch.{name}(...) without device=")]
            parts: list[ast.expr] = [*value.args, *(k.value for k in value.keywords)]
            if isinstance(value.func, ast.Attribute) and name is None:
                parts.append(value.func.value)  # x.pow(2), total.full_tensor(): x's device
            return [p for part in parts for p in self.problems(part, function, before, seen)]
        if isinstance(value, ast.Name):
            made = _latest_assignment(function, value.id, before)
            if made is None:
                return []  # a parameter, a loop variable, a global: made elsewhere
            line, source = made
            return self.problems(source, function, line, seen)
        if isinstance(value, ast.Attribute):
            sources = [v for v in self.attributes.get(value.attr, []) if not _is_none(v)]
            found: list[tuple[int, str]] = []
            for source in sources:
                found += self.problems(source, function, source.lineno + 1, seen)
            return found
        children = [c for c in ast.iter_child_nodes(value) if isinstance(c, ast.expr)]
        if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
            children = [value.elt]
        return [p for child in children for p in self.problems(child, function, before, seen)]


def _assignments(node: ast.AST) -> list[tuple[ast.expr, ast.expr]]:
    if isinstance(node, ast.Assign):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        for target in node.targets:
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs += list(zip(target.elts, node.value.elts, strict=False))
            else:
                pairs.append((target, node.value))
        return pairs
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        return [(node.target, node.value)]
    return []


def _latest_assignment(function: ast.AST, name: str, before: int) -> tuple[int, ast.expr] | None:
    latest: tuple[int, ast.expr] | None = None
    for node in ast.walk(function):
        for target, value in _assignments(node):
            if isinstance(target, ast.Name) and target.id == name and node.lineno < before:
                if latest is None or node.lineno > latest[0]:
                    latest = (node.lineno, value)
    return latest


def _torch_function(func: ast.expr) -> str | None:
    """`zeros` for `torch.zeros`; None for anything not called on the torch module."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "torch":
        return func.attr
    return None


def _is_none(value: ast.expr) -> bool:
    return isinstance(value, ast.Constant) and value.value is None


def _collective(call: ast.Call) -> tuple[str, ast.expr] | None:
    """(`all_reduce`, its tensor) for `dist.all_reduce(tensor, ...)`; None for any other call."""
    func = call.func
    if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "dist"):
        return None
    keyword = next((k.value for k in call.keywords if k.arg in ("tensor", "output", "output_tensor")), None)
    tensor = call.args[0] if call.args else keyword
    return (func.attr, tensor) if func.attr in COLLECTIVES and tensor is not None else None


def tensors_made_without_a_device(source: str, file: str) -> list[Finding]:
    tree = ast.parse(source)
    module = _Module(tree)
    findings = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for call in ast.walk(function):
            if not isinstance(call, ast.Call) or (collective := _collective(call)) is None:
                continue
            name, tensor = collective
            for line, what in module.problems(tensor, function, call.lineno, set()):
                findings.append(Finding(file, call.lineno, f"dist.{name} gets a tensor made at line {line}: {what}"))
    return sorted(set(findings), key=lambda f: (f.file, f.line, f.what))


def test_no_collective_in_training_gets_a_tensor_made_without_a_device() -> None:
    findings = [
        finding
        for path in sorted(TRAINING.rglob("*.py"))
        for finding in tensors_made_without_a_device(path.read_text(), str(path.relative_to(TRAINING.parent)))
    ]
    assert [str(f) for f in findings] == []


def test_the_scan_finds_an_agreement_on_a_cpu_tensor_through_names_stacks_and_attributes() -> None:
    source = '''
import torch
import torch.distributed as dist

def newest(held, device):
    newest = torch.tensor([max(held)], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    both = torch.stack([newest, torch.zeros(1, device=device)])
    dist.all_reduce(both)
    fine = torch.zeros(2, device=device)
    dist.all_reduce(fine)
    derived = fine.pow(2)
    dist.all_reduce(derived)

class Buckets:
    def fill(self):
        self.flat = torch.empty(8)

    def reduce(self):
        dist.all_reduce(self.flat, async_op=True)
'''
    found = [(f.line, f.what) for f in tensors_made_without_a_device(source, "example.py")]
    assert found == [
        (7, "dist.all_reduce gets a tensor made at line 6: torch.tensor(...) without device="),
        (9, "dist.all_reduce gets a tensor made at line 6: torch.tensor(...) without device="),
        (20, "dist.all_reduce gets a tensor made at line 17: torch.empty(...) without device="),
    ]
