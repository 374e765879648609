"""pipecut: a graph-partitioning compiler for pipeline-parallel training in PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"

from pipecut.api import compile
from pipecut.devices import estimate_costs
from pipecut.errors import (
    CaptureError,
    InputError,
    PartitionError,
    PipecutError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
)
from pipecut.plan import (
    CaptureMethod,
    DeviceSpec,
    Link,
    Plan,
    Recompute,
    ScheduleKind,
)
from pipecut.planner import plan
from pipecut.render import render

__all__ = [
    "CaptureError",
    "CaptureMethod",
    "DeviceSpec",
    "InputError",
    "Link",
    "PartitionError",
    "PipecutError",
    "PipelineRuntimeError",
    "Plan",
    "PlanError",
    "Recompute",
    "ScheduleError",
    "ScheduleKind",
    "__version__",
    "compile",
    "estimate_costs",
    "plan",
    "render",
]
