"""Imports go down a floor, never up: flows -> tasks -> jfcore, jfcore imports no orchestration or tracking library,
and jfcore's own parts (its subpackages and top modules) import each other without a cycle. Read from the sources'
syntax trees, so an import inside a function counts too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLOORS = ("flows", "tasks", "jfcore")  # top floor first
SERVICES = ("prefect", "ray", "mlflow")  # the orchestration and tracking stack stays out of jfcore


def imports(package: str) -> dict[str, set[str]]:
    """Module name -> the absolute module names it imports, for every module of `package`."""
    found = {}
    for path in sorted((REPO / package).rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[module] = names
    return found


def test_imports_only_go_down_a_floor():
    upward = [
        f"{module} imports {name}"
        for floor, package in enumerate(FLOORS)
        for module, names in imports(package).items()
        for name in names
        if name.split(".")[0] in FLOORS[:floor]
    ]
    assert not upward, upward
    services = [
        f"{module} imports {name}"
        for module, names in imports("jfcore").items()
        for name in names
        if name.split(".")[0] in SERVICES
    ]
    assert not services, services


def part(module: str) -> str:
    """A module's part of jfcore: its subpackage (jfcore.decoding) or top module (jfcore.metadata)."""
    return ".".join(module.split(".")[:2])


def test_jfcores_parts_import_each_other_without_a_cycle():
    graph = defaultdict(set)
    for module, names in imports("jfcore").items():
        for name in names:
            if name.startswith("jfcore.") and part(name) != part(module):
                graph[part(module)].add(part(name))
    assert graph["jfcore.evaluation"] and graph["jfcore.tuning"]  # the graph was read

    def cycle_from(start: str) -> list[str] | None:
        path, stack = [start], [iter(sorted(graph[start]))]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop(), path.pop()
            elif step == start:
                return [*path, start]
            elif step not in path:
                path.append(step), stack.append(iter(sorted(graph[step])))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, [" -> ".join(c) for c in cycles]
