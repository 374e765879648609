"""pipecut.passes: pure functions over cost tables, graphs and plans (no process groups).

The names below are the documented entry points; every module also declares its own
``__all__``. (They are imported here, not lazily: ``workload`` and ``split`` are also module
names, and a lazily exported function would be shadowed by its module once that loads.)
"""

from __future__ import annotations

from pipecut.core.program import StageProgram
from pipecut.passes.costs.workload import Workload, workload
from pipecut.passes.parallel.hybrid import ShapeChoice, plan_hybrid
from pipecut.passes.parallel.replication import ReplicationKind
from pipecut.passes.partition.ilp import IlpSolver
from pipecut.passes.rewrite.split import split, split_stage

__all__ = [
    "IlpSolver",
    "ReplicationKind",
    "ShapeChoice",
    "StageProgram",
    "Workload",
    "plan_hybrid",
    "split",
    "split_stage",
    "workload",
]
