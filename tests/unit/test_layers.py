"""The package's folders are layers, bottom to top, and no import points upwards.

1. data: the plan (``pipecut.ir``, ``errors``, ``schema``, ``cluster``,
   ``version``), the options (``pipecut.options``), ``pipecut.core`` (kinds, programs, values,
   shapes) and ``pipecut.schedules`` (the schedule format, its generators and the one
   simulator: pure functions over numbers and names, which the runtime replays);
2. passes (``pipecut.passes``): pure functions over data;
3. runtime (``pipecut.runtime``): executes a plan's programs and schedule;
4. everything else: capture, profiling, planning (``pipecut.planning``), ``compile``, reports,
   the CLI.

Passes and the runtime are siblings on top of the data: neither imports the other. Imports
inside functions count too (they are still dependencies); ``if TYPE_CHECKING:`` blocks do not.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"compiler": "pipecut", "passes": "pipecut.passes", "runtime": "pipecut.runtime"}
DATA = ("pipecut.ir", "pipecut.version", "pipecut.schedules", "pipecut.errors", "pipecut.schema", "pipecut.cluster",
        "pipecut.options", "pipecut.core")


def layer(module: str) -> str:
    if module.startswith("pipecut.passes"):
        return "passes"
    if module.startswith("pipecut.runtime"):
        return "runtime"
    if any(module == d or module.startswith(d + ".") for d in DATA):
        return "data"
    return "top"


ALLOWED = {"data": {"data"}, "passes": {"data", "passes"}, "runtime": {"data", "runtime"},
           "top": {"data", "passes", "runtime", "top"}}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imports(path: Path) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def test_no_module_imports_a_layer_above_or_beside_its_own() -> None:
    known = modules()
    wrong = []
    for module, path in sorted(known.items()):
        for imported in sorted(imports(path)):
            if imported not in known:  # "from pipecut.ir import Plan" names a class, not a module
                continue
            if layer(imported) not in ALLOWED[layer(module)]:
                wrong.append(f"{module} ({layer(module)}) imports {imported} ({layer(imported)})")
    assert not wrong, "\n".join(wrong)


def test_the_rule_is_checked_on_every_module() -> None:
    known = modules()
    assert {"pipecut.schedules.format", "pipecut.passes.rewrite.split", "pipecut.runtime.pipeline",
            "pipecut.api", "pipecut.report.render", "pipecut.planning.planner", "pipecut.options",
            "pipecut.passes.partition.ilp"} <= set(known)
    assert {layer(m) for m in known} == {"data", "passes", "runtime", "top"}


@pytest.mark.parametrize("source, bad", [
    ("from pipecut.runtime.pipeline import Pipeline", True),
    ("import pipecut.runtime.pipeline", True),
    ("def f():\n    from pipecut.runtime import pipeline", True),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipecut.runtime.pipeline import Pipeline", False),
    ("from pipecut.schedules.format import Action", False),
])
def test_the_checker_sees_a_pass_importing_the_runtime(tmp_path: Path, source: str, bad: bool) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    found = {m for m in imports(path) if m in modules()}
    assert any(layer(m) == "runtime" for m in found) == bad


def test_planning_runs_in_one_process_below_the_build() -> None:
    """``pipecut.planning`` (cost tables, plans) imports neither the runtime nor what builds and
    runs a pipeline (``pipecut.assemble``, ``pipecut.api``, the CLI): planning needs no process
    group, and compile's steps sit on top of it, not the other way round."""
    known = modules()
    above = ("pipecut.runtime", "pipecut.assemble", "pipecut.api", "pipecut.cli")
    wrong = [f"{module} imports {imported}"
             for module, path in sorted(known.items()) if module.startswith("pipecut.planning")
             for imported in sorted(imports(path)) if imported in known and imported.startswith(above)]
    assert {m for m in known if m.startswith("pipecut.planning.")} >= {
        "pipecut.planning.planner", "pipecut.planning.autoplan"}
    assert not wrong, "\n".join(wrong)


PURE_NUMBERS = ("pipecut.planning.cluster.run", "pipecut.planning.cluster.stage",
                "pipecut.planning.cluster.schedule", "pipecut.planning.cluster.foreign")
"""The cluster planner's run model: pure numbers over a workload, kept in the planner's package
(read top to bottom there) but held to the passes' rule."""


@pytest.mark.parametrize("module", PURE_NUMBERS)
def test_the_cluster_run_model_is_pure_numbers(module: str) -> None:
    """No torch and nothing above the passes: the run model prices a workload of numbers, so it
    runs (and is tested) without capturing anything; only data, passes and its own package."""
    known = modules()
    wrong = sorted(i for i in imports(known[module])
                   if i.split(".")[0] == "torch" or (i in known and layer(i) not in ("data", "passes")
                                                     and not i.startswith("pipecut.planning.cluster.")))
    assert not wrong, f"{module} imports {wrong}"
    own = {i for i in imports(known[module]) if i.startswith("pipecut.planning.cluster.") and i in known}
    assert own <= set(PURE_NUMBERS), f"{module} imports {own - set(PURE_NUMBERS)} of the front"
