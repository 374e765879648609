"""pipecut.passes: pure functions over cost tables, graphs and plans (no process groups).

The names below are the documented entry points; every module also declares its own
``__all__``. They load on first use (PEP 562), so importing one pass does not import them all,
and this package's import order cannot form a cycle with :mod:`pipecut.runtime`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipecut.passes.hybrid import HybridPlan, plan_hybrid
    from pipecut.passes.ilp import IlpSolver
    from pipecut.passes.replication import ReplicationKind
    from pipecut.passes.split import StageProgram, split, split_stage
    from pipecut.passes.synthetic import transformer_costs
    from pipecut.passes.workload import Workload, workload

_HOME = {
    "HybridPlan": "hybrid",
    "IlpSolver": "ilp",
    "ReplicationKind": "replication",
    "StageProgram": "split",
    "Workload": "workload",
    "plan_hybrid": "hybrid",
    "split": "split",
    "split_stage": "split",
    "transformer_costs": "synthetic",
    "workload": "workload",
}

__all__ = [
    "HybridPlan",
    "IlpSolver",
    "ReplicationKind",
    "StageProgram",
    "Workload",
    "plan_hybrid",
    "split",
    "split_stage",
    "transformer_costs",
    "workload",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module 'pipecut.passes' has no attribute {name!r}")
    return getattr(importlib.import_module(f"pipecut.passes.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
