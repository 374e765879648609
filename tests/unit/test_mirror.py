"""Tests mirror modules: a newcomer finds the tests of a module in the file named after it.

The rule. A package module is every ``.py`` file under ``compiler/`` (``pipecut``),
``passes/`` (``pipecut.passes``) and ``runtime/`` (``pipecut.runtime``) but ``__init__`` and
``__main__``. Its *file name* is the name without ``.py``; its *package* is the last
package of its dotted name (``core``, ``capture``, ``profile``, ``report``, ``cli``,
``passes``, ``runtime``, or ``pipecut`` for a top-level module). Its tests live in
``tests/unit/`` or ``tests/dist/``, in

- ``test_<file name>.py`` (``pipecut.core.cut_values`` → ``test_values.py``), unless two modules
  share that file name, or
- ``test_<package>_<file name>.py``, always accepted, and required for shared file names
  (``pipecut.capture.trace`` → ``test_capture_trace.py``, ``pipecut.runtime.execution.trace`` →
  ``test_runtime_trace.py``); use it too where the bare name says little
  (``pipecut.profile.nodes`` → ``test_profile_nodes.py``).

Test files named by feature (``test_layers.py``, ``test_regressions.py``, …) are welcome
besides; they just do not count as a module's home.

A module whose behaviour is tested elsewhere may be listed in :data:`EXEMPT` with the file
that covers it and why. Keep the list short: a new module gets a new test file.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"compiler": "pipecut", "passes": "pipecut.passes", "runtime": "pipecut.runtime"}
TEST_DIRS = (ROOT / "tests" / "unit", ROOT / "tests" / "dist")

EXEMPT: dict[str, tuple[str, str]] = {
    "pipecut.api": (
        "tests/dist/test_parity.py", "compile() builds a pipeline across processes; every tests/dist file runs it"),
    "pipecut.build.choice": (
        "tests/dist/test_parity.py", "compile()'s capture/plan/check step: needs a process group"),
    "pipecut.build.context": (
        "tests/dist/test_parity.py", "compile()'s connect step: needs a process group"),
    "pipecut.build.workers": (
        "tests/dist/test_parity.py", "compile()'s build/materialise/sync steps: need a process group"),
    "pipecut.passes.parallel.run_costs": (
        "tests/unit/test_cluster_schedules.py", "a cluster run's per-stage costs: checked through the runs they price"),
    "pipecut.passes.parallel.run_schedule": (
        "tests/unit/test_cluster_schedules.py", "a cluster run's schedule, weight pass and memory walk, by hand-worked values"),
    "pipecut.planning.run_plan": (
        "tests/unit/test_cluster_schedules.py", "the plan of the chosen cluster run: its stages agree with the run line"),
    "pipecut.runtime.pipeline": (
        "tests/dist/test_training_loop.py", "the Pipeline object only runs across processes: the README's loop"),
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


def _test_files() -> set[str]:
    return {p.name for d in TEST_DIRS for p in d.glob("test_*.py")}


def accepted_names(dotted: str, shared: set[str]) -> tuple[str, ...]:
    """The test file names the rule accepts for a module, the bare one first."""
    package, _, stem = dotted.rpartition(".")
    qualified = f"test_{package.rpartition('.')[2]}_{stem}.py"
    return (qualified,) if stem in shared else (f"test_{stem}.py", qualified)


def _shared_stems(names: list[str]) -> set[str]:
    counts = Counter(n.rpartition(".")[2] for n in names)
    return {stem for stem, c in counts.items() if c > 1}


def test_rule_examples() -> None:
    shared = {"trace"}
    assert accepted_names("pipecut.core.cut_values", shared) == ("test_cut_values.py", "test_core_cut_values.py")
    assert accepted_names("pipecut.errors", shared) == ("test_errors.py", "test_pipecut_errors.py")
    assert accepted_names("pipecut.runtime.execution.trace", shared) == ("test_execution_trace.py",)
    assert accepted_names("pipecut.capture.trace", shared) == ("test_capture_trace.py",)
    assert _shared_stems(["pipecut.capture.trace", "pipecut.runtime.execution.trace", "pipecut.ir"]) == {"trace"}


def test_every_module_has_a_test_file() -> None:
    mods = modules()
    assert "pipecut.core.cut_values" in mods and "pipecut.runtime.execution.stage" in mods  # the walk works
    shared = _shared_stems(list(mods))
    have = _test_files()
    missing = []
    for name in sorted(mods):
        names = accepted_names(name, shared)
        if name not in EXEMPT and not have.intersection(names):
            missing.append(f"{name} ({mods[name].relative_to(ROOT)}): add tests/unit/{names[0]} "
                           f"(or tests/dist/{names[0]})")
    assert not missing, "modules without a test file of their own:\n  " + "\n  ".join(missing)


def test_exemptions_are_current() -> None:
    """Each exemption names a module that exists and has no file of its own yet, and a covering
    test file that exists; otherwise its entry is to be deleted or corrected."""
    mods = modules()
    shared = _shared_stems(list(mods))
    have = _test_files()
    stale = []
    for name, (covering, why) in EXEMPT.items():
        assert why.strip(), f"say why {name} is exempt"
        if name not in mods:
            stale.append(f"{name} is no longer a module: delete its entry")
        elif have.intersection(accepted_names(name, shared)):
            stale.append(f"{name} now has its own test file: delete its entry")
        if not (ROOT / covering).is_file():
            stale.append(f"{name}: covering file {covering} does not exist")
    assert not stale, "\n".join(stale)
    assert len(EXEMPT) < 12, "keep the exemptions few: give modules their own test files"
