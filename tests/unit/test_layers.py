"""Imports go down a floor, never up: cli -> flows -> tasks -> jfcore (the entry points, the flow, its stages, the
library), jfcore imports no orchestration or tracking library,
jfcore's own parts (its subpackages and top modules) import each other without a cycle, and so do the decoder's
modules, whose parts keep floors of their own (docs/DESIGN.md, section 10). Read from the sources' syntax trees, so
an import inside a function or under TYPE_CHECKING counts too."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FLOORS = ("cli", "flows", "tasks", "jfcore")  # top floor first
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
    """A module's part of jfcore: its subpackage (jfcore.decoding) or top module (jfcore.jacobi_forcing_json)."""
    return ".".join(module.split(".")[:2])


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every node's first cycle back to itself, if any, as "a -> b -> a"."""

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

    return [" -> ".join(c) for c in map(cycle_from, sorted(graph)) if c]


def test_jfcores_parts_import_each_other_without_a_cycle():
    graph = defaultdict(set)
    for module, names in imports("jfcore").items():
        for name in names:
            if name.startswith("jfcore.") and part(name) != part(module):
                graph[part(module)].add(part(name))
    assert graph["jfcore.evaluation"] and graph["jfcore.tuning"]  # the graph was read
    assert not cycles(graph), cycles(graph)


# The decoder's parts, top floor first: the loop, the scheduler, the rules (and the references tests and
# benchmarks compare with), then what they use (the model runner, a row, its candidates), then plain values.
DECODING_FLOORS = (
    ("__init__", "decoder"),
    ("scheduler",),
    ("rules", "reference"),
    ("runner", "row", "candidates"),
    ("config", "result", "sampling"),
)


def decoding_part(module: str) -> str:
    """jfcore.decoding.rules.native -> rules; jfcore.decoding -> __init__."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_the_decoders_modules_import_only_down_its_floors_and_without_a_cycle():
    floor = {name: i for i, names in enumerate(DECODING_FLOORS) for name in names}
    modules = {m: names for m, names in imports("jfcore").items() if m.split(".")[:2] == ["jfcore", "decoding"]}
    assert {decoding_part(m) for m in modules} == set(floor), "a new part of jfcore/decoding needs its floor here"
    graph = defaultdict(set)
    upward = []
    for module, names in modules.items():
        for name in names:
            if name in modules or name.startswith("jfcore.decoding."):
                graph[module].add(name)
                if floor[decoding_part(name)] < floor[decoding_part(module)]:
                    upward.append(f"{module} imports {name}")
    assert graph["jfcore.decoding.scheduler"] and graph["jfcore.decoding.rules.native"]  # the graph was read
    assert not upward, upward
    assert not cycles(graph), cycles(graph)
