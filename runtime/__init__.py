"""pipecut.runtime: runs a plan's stages on torch.distributed ranks (never imports a pass).

The names below are the documented entry points; every module also declares its own
``__all__``. They load on first use (PEP 562), so reading a schedule does not start
torch.distributed machinery, and this package's import order cannot form a cycle with
:mod:`pipecut.passes`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipecut.runtime.checkpoint import latest, load, load_into_model, save
    from pipecut.runtime.pipeline import Pipeline
    from pipecut.runtime.schedule import (
        Action,
        ActionKind,
        Schedule,
        format_schedule,
        parse_schedule,
    )

_HOME = {
    "Action": "schedule",
    "ActionKind": "schedule",
    "Pipeline": "pipeline",
    "Schedule": "schedule",
    "format_schedule": "schedule",
    "latest": "checkpoint",
    "load": "checkpoint",
    "load_into_model": "checkpoint",
    "parse_schedule": "schedule",
    "save": "checkpoint",
}

__all__ = [
    "Action",
    "ActionKind",
    "Pipeline",
    "Schedule",
    "format_schedule",
    "latest",
    "load",
    "load_into_model",
    "parse_schedule",
    "save",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pipecut.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipecut.runtime.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
