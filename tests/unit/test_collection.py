"""Every test file on disk runs: pytest collects each ``test_*.py`` under ``tests/``.

The check that was missing when ``tests/unit/build/`` (17 tests) sat in pytest's default
``norecursedirs`` for months: ``make test`` and ``make test-fast`` collected nothing from it.
"""

from __future__ import annotations

from tests.collection import collected_files, files_on_disk


def test_every_test_file_on_disk_is_collected() -> None:
    on_disk, collected = files_on_disk(), collected_files()
    assert "tests/unit/test_collection.py" in on_disk and "tests/unit/assemble/test_tensor.py" in on_disk
    missing = sorted(on_disk - collected)
    assert not missing, (
        "test files pytest does not collect (a folder in norecursedirs, a name pytest skips, a module "
        "that defines no test?); they never run:\n  " + "\n  ".join(missing)
    )


def test_the_multiprocess_tests_are_collected_too() -> None:
    """The folder of the multi-process tests was once called ``dist``, another default exclude."""
    assert any(f.startswith("tests/multiprocess/") for f in collected_files())
