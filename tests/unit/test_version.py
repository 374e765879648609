"""The version is written once (``pipecut.version``) and read by the package and pyproject."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pipecut
from pipecut.version import __version__


def test_one_version() -> None:
    assert pipecut.__version__ == __version__
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pipecut.version.__version__"}
