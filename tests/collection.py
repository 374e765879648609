"""What pytest collects, as a set of test files: the suite's own view of itself.

A test file on disk that pytest does not collect never runs, and nothing says so: a folder named
``build`` or ``dist`` (both in pytest's default ``norecursedirs``) once hid 17 unit tests from
``make test`` while a test that only checked the files existed stayed green. So the checks
(``tests/unit/test_collection.py``, ``tests/unit/test_mirror.py``) ask pytest itself, in a
process of its own, with the project's configuration and no marker filter.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@functools.cache
def collected_files() -> frozenset[str]:
    """The test files (relative to the repository, ``/``-separated) that ``pytest --collect-only``
    finds under ``tests/`` with the project's configuration."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    ids = [line for line in run.stdout.splitlines() if "::" in line]
    if run.returncode != 0 or not ids:
        raise RuntimeError(f"pytest --collect-only failed ({run.returncode}):\n{run.stdout[-4000:]}\n{run.stderr[-2000:]}")
    return frozenset(line.split("::", 1)[0] for line in ids)


def files_on_disk() -> frozenset[str]:
    """Every ``test_*.py`` under ``tests/`` (pytest's default ``python_files``), relative to the
    repository."""
    return frozenset(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")
                     if "__pycache__" not in p.parts)
