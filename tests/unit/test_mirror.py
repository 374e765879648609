"""Tests mirror modules: a newcomer finds the tests of a module in the file named after it, in
the folder named after its package.

The rule. A package module is every ``.py`` file under ``compiler/`` (``pipecut``),
``passes/`` (``pipecut.passes``) and ``runtime/`` (``pipecut.runtime``) but ``__init__`` and
``__main__``. Its unit tests live at ``tests/unit/<its package path>/test_<file name>.py``:
``pipecut.core.cut_values`` → ``tests/unit/core/test_cut_values.py``,
``pipecut.runtime.execution.trace`` → ``tests/unit/runtime/execution/test_trace.py``,
``pipecut.errors`` → ``tests/unit/test_errors.py``. A module that only runs across processes
may instead have ``tests/multiprocess/test_<file name>.py`` (or ``test_<package>_<file name>.py`` where
two modules share the file name: ``tests/multiprocess`` is one folder).

Test files named by feature (``test_layers.py``, ``test_regressions.py``, …) are welcome
besides, at ``tests/unit/`` or beside the module they are about; they do not count as a
module's home.

A module whose behaviour is tested elsewhere may be listed in :data:`EXEMPT` with the file
that covers it and why. Keep the list short: a new module gets a new test file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.collection import collected_files

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"compiler": "pipecut", "passes": "pipecut.passes", "runtime": "pipecut.runtime"}

EXEMPT: dict[str, tuple[str, str]] = {
    "pipecut.api": (
        "tests/multiprocess/test_parity.py", "compile() builds a pipeline across processes; every tests/multiprocess file runs it"),
    "pipecut.assemble.context": (
        "tests/multiprocess/test_parity.py", "compile()'s connect step: needs a process group"),
    "pipecut.assemble.workers": (
        "tests/multiprocess/test_parity.py", "compile()'s build/materialise/sync steps: need a process group"),
    "pipecut.planning.cluster.stage": (
        "tests/unit/planning/cluster/test_schedule.py", "a cluster run's per-stage costs: checked through the runs they price"),
    "pipecut.runtime.pipeline": (
        "tests/multiprocess/test_training_loop.py", "the Pipeline object only runs across processes: the README's loop"),
}
"""Module -> (test file that covers it, relative to the repository; why it has no own file)."""


def modules() -> dict[str, Path]:
    """Dotted name -> file of every package module."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.stem in ("__init__", "__main__"):
                continue
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            found[".".join((package, *parts))] = path
    return found


def homes(dotted: str, shared: set[str]) -> tuple[str, ...]:
    """The test files, relative to the repository, the rule accepts for a module: its unit file
    first."""
    parts = dotted.split(".")[1:]  # without "pipecut"
    stem, package = parts[-1], parts[:-1]
    unit = "/".join(("tests", "unit", *package, f"test_{stem}.py"))
    qualified = f"tests/multiprocess/test_{(package or ['pipecut'])[-1]}_{stem}.py"
    return (unit, qualified) if stem in shared else (unit, f"tests/multiprocess/test_{stem}.py", qualified)


def _shared_stems(names: list[str]) -> set[str]:
    counts = Counter(n.rpartition(".")[2] for n in names)
    return {stem for stem, c in counts.items() if c > 1}


def _have(names: tuple[str, ...]) -> bool:
    """Whether one of ``names`` is a test file pytest collects (a file that exists but is not
    collected never runs: ``tests/unit/build/`` once was such a folder)."""
    collected = collected_files()
    return any(n in collected for n in names)


def test_rule_examples() -> None:
    shared = {"trace"}
    assert homes("pipecut.core.cut_values", shared) == (
        "tests/unit/core/test_cut_values.py", "tests/multiprocess/test_cut_values.py", "tests/multiprocess/test_core_cut_values.py")
    assert homes("pipecut.errors", shared)[0] == "tests/unit/test_errors.py"
    assert homes("pipecut.runtime.execution.trace", shared) == (
        "tests/unit/runtime/execution/test_trace.py", "tests/multiprocess/test_execution_trace.py")
    assert _shared_stems(["pipecut.capture.trace", "pipecut.runtime.execution.trace", "pipecut.ir"]) == {"trace"}


def test_unit_folders_mirror_the_packages() -> None:
    """Every folder under tests/unit is a package folder of pipecut (no stray layout), and is a
    Python package (its test modules get distinct names)."""
    folders = {".".join(m.split(".")[1:-1]) for m in modules()} - {""}
    prefixes = {".".join(f.split(".")[:i]) for f in folders for i in range(1, len(f.split(".")) + 1)}
    unit = ROOT / "tests" / "unit"
    for d in unit.rglob("*"):
        if d.is_dir() and d.name != "__pycache__":
            dotted = ".".join(d.relative_to(unit).parts)
            assert dotted in prefixes, f"tests/unit/{d.relative_to(unit)} mirrors no package of pipecut"
            assert (d / "__init__.py").is_file(), f"tests/unit/{d.relative_to(unit)} lacks __init__.py"


def test_every_module_has_a_test_file() -> None:
    mods = modules()
    assert "pipecut.core.cut_values" in mods and "pipecut.runtime.execution.stage" in mods  # the walk works
    shared = _shared_stems(list(mods))
    missing = []
    for name in sorted(mods):
        names = homes(name, shared)
        if name not in EXEMPT and not _have(names):
            missing.append(f"{name} ({mods[name].relative_to(ROOT)}): add {names[0]} (or {names[1]})")
    assert not missing, "modules without a test file of their own:\n  " + "\n  ".join(missing)


def test_exemptions_are_current() -> None:
    """Each exemption names a module that exists and has no file of its own yet, and a covering
    test file that exists; otherwise its entry is to be deleted or corrected."""
    mods = modules()
    shared = _shared_stems(list(mods))
    stale = []
    for name, (covering, why) in EXEMPT.items():
        assert why.strip(), f"say why {name} is exempt"
        if name not in mods:
            stale.append(f"{name} is no longer a module: delete its entry")
        elif _have(homes(name, shared)):
            stale.append(f"{name} now has its own test file: delete its entry")
        if covering not in collected_files():
            stale.append(f"{name}: covering file {covering} does not exist or is not collected")
    assert not stale, "\n".join(stale)
    assert len(EXEMPT) < 12, "keep the exemptions few: give modules their own test files"
