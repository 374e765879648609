"""pipecut.runtime: runs a plan's stages on torch.distributed ranks (never imports a pass).

The names below are the documented entry points; every module also declares its own
``__all__``. They load on first use (PEP 562), so reading a schedule does not start
torch.distributed machinery, and this package's import order cannot form a cycle with
:mod:`pipecut.passes`.

The runtime's rooms: :mod:`~pipecut.runtime.comm.wire` (process groups, transfers, failures),
:mod:`~pipecut.runtime.execution` (stages running actions), :mod:`~pipecut.runtime.grads.collective`
(gradients across ranks), :mod:`~pipecut.runtime.state` (checkpoints, weights,
``save_pretrained``) and :mod:`~pipecut.runtime.memory.activations`; :mod:`~pipecut.runtime.pipeline`
(the :class:`Pipeline` a user holds) sits on top of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipecut.runtime.pipeline import Pipeline
    from pipecut.runtime.state import checkpoint
    from pipecut.runtime.state.checkpoint import latest, load, load_into_model, save
    from pipecut.schedules.format import (
        Action,
        ActionKind,
        Schedule,
        format_schedule,
        parse_schedule,
    )

_MODULES = {"checkpoint": "pipecut.runtime.state.checkpoint"}
"""Public modules by their short name (``from pipecut.runtime import checkpoint as ckpt``)."""

_HOME = {
    "Action": "pipecut.schedules.format",
    "ActionKind": "pipecut.schedules.format",
    "Pipeline": "pipecut.runtime.pipeline",
    "Schedule": "pipecut.schedules.format",
    "format_schedule": "pipecut.schedules.format",
    "latest": "pipecut.runtime.state.checkpoint",
    "load": "pipecut.runtime.state.checkpoint",
    "load_into_model": "pipecut.runtime.state.checkpoint",
    "parse_schedule": "pipecut.schedules.format",
    "save": "pipecut.runtime.state.checkpoint",
}

__all__ = [
    "Action",
    "ActionKind",
    "Pipeline",
    "Schedule",
    "checkpoint",
    "format_schedule",
    "latest",
    "load",
    "load_into_model",
    "parse_schedule",
    "save",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    if name not in _HOME:
        raise AttributeError(f"module 'pipecut.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOME[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
