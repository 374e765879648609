"""No module of pipecut imports another that imports it back, directly or around a loop.

A circle makes the import order matter (a module sees a half-initialised partner) and makes the
modules one unit that cannot be read, tested or moved apart. The graph: one node per module
(a package is its ``__init__``), an edge for every import that runs when the module loads, that
is every import outside functions and outside ``if TYPE_CHECKING:``. ``from pkg import name``
points at ``pkg.name`` when that is a module, else at ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_layers import _type_checking, modules


def load_time_imports(path: Path, known: set[str], package: str) -> set[str]:
    """The pipecut modules ``path`` imports when it loads (``package``: its own package, for
    relative imports)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If):
                if not _type_checking(node):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)
            elif isinstance(node, (ast.With,)):
                visit(node.body)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{parent}.{base}" if base else parent
                for a in node.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in known}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        graph[name] = load_time_imports(path, set(known), package) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for root in sorted(graph):
        if state.get(root):
            continue
        path = [root]
        stack = [iter(sorted(graph[root]))]
        state[root] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return [*path[path.index(child):], child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph.get(child, ()))))
    return None


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert {"pipecut.runtime.pipeline", "pipecut.runtime.state.export", "pipecut.api"} <= set(graph)
    assert "pipecut.runtime.state.export" in graph["pipecut.runtime.pipeline"]  # edges are seen
    cycle = find_cycle(graph)
    assert cycle is None, "modules import each other in a circle: " + " -> ".join(cycle or ())


@pytest.mark.parametrize("graph, cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
    ({"a": {"b", "c"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
])
def test_find_cycle_names_the_circle(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_type_checking_and_function_imports_are_not_edges(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pipecut.x\n"
                    "def f():\n    import pipecut.y\nimport pipecut.z\n")
    assert load_time_imports(path, {"pipecut.x", "pipecut.y", "pipecut.z"}, "pipecut") == {"pipecut.z"}
