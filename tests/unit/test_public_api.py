"""The public surface: what the docs import exists, every module says what it exports."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import logging
import re
from importlib import resources
from pathlib import Path

import pytest

import pipecut
from pipecut.core.kinds import CostSource
from tests.docs import code

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"compiler": "pipecut", "passes": "pipecut.passes", "runtime": "pipecut.runtime"}


def _modules() -> list[tuple[Path, str]]:
    out = []
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):  # subpackages (core/, cli/, ...) too
            if path.name == "__main__.py":
                continue  # a script (`python -m pipecut`), not an importable module
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out.append((path, ".".join((package, *parts))))
    return out


@pytest.mark.parametrize(("path", "name"), _modules(), ids=[m for _, m in _modules()])
def test_every_module_declares_its_public_names(path: Path, name: str) -> None:
    tree = ast.parse(path.read_text())
    declared = [n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                and "__all__" in ast.unparse(n.targets[0] if isinstance(n, ast.Assign) else n.target)]
    assert declared, f"{path.relative_to(ROOT)} has no __all__; list its public names"
    module = importlib.import_module(name)
    missing = [x for x in module.__all__ if not hasattr(module, x)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not define"
    assert list(module.__all__) == sorted(set(module.__all__), key=list(module.__all__).index)


def test_subpackages_export_their_documented_entry_points() -> None:
    from pipecut.passes import IlpSolver, ReplicationKind, plan_hybrid, workload
    from pipecut.runtime import Pipeline, latest, load, parse_schedule, save

    assert IlpSolver.HIGHS.value == "highs" and ReplicationKind.PER_STAGE
    assert callable(plan_hybrid) and callable(workload) and callable(parse_schedule)
    assert Pipeline.__name__ == "Pipeline" and {save, load, latest}
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        pipecut.passes.nothing  # noqa: B018


def test_the_docs_plan_for_hardware_that_is_not_here(capsys) -> None:
    """docs/clusters.md's estimate_costs → partition_costs → choose_replicas block runs as written."""
    from examples import mlp

    model, (x,), loss_fn, y = mlp.build(batch_size=16, width=32, depth=4)
    scope = {"model": model, "x": x, "loss_fn": loss_fn, "y": y}
    exec(code("docs/clusters.md", "partition_costs"), scope)
    plan = scope["plan"]
    assert plan.num_stages == 4 and plan.devices[0].name == "A100-80GB"
    assert {n.source for n in plan.nodes} == {CostSource.ESTIMATED}
    assert "replicas ×" in capsys.readouterr().out
    assert scope["choice"].replicas * scope["choice"].stages == 8


def test_packaging_facts() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]", 1)[1].split("\n[", 1)[0]  # (tomllib is 3.11+ only)
    assert 'dynamic = ["version"]' in project and not re.search(r"^version\s*=", project, re.M)
    assert importlib.metadata.version("pipecut") == pipecut.__version__  # the one source
    assert 'license = { text = "Apache-2.0" }' in project
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert resources.files("pipecut").joinpath("py.typed").is_file()
    deps = project.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "pydantic" in deps and "highspy" in deps
    assert "jsonschema" not in deps and "networkx" not in deps
    handlers = logging.getLogger("pipecut").handlers
    assert any(isinstance(h, logging.NullHandler) for h in handlers)


def test_every_package_folder_is_listed_for_setuptools() -> None:
    """``pyproject.toml`` lists the packages by name; a folder missing from the list is left out
    of the wheel and out of an editable install (``pipecut.planning.cluster`` once was, found when
    its tests stopped importing after a reinstall)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"compiler": "pipecut", "passes": "pipecut.passes", "runtime": "pipecut.runtime"}
    on_disk = {".".join((package, *init.parent.relative_to(ROOT / folder).parts))
               for folder, package in roots.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert on_disk - listed == set(), f"packages not in pyproject.toml: {sorted(on_disk - listed)}"
