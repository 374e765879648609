"""pipecut: a graph-partitioning compiler for pipeline-parallel training in PyTorch."""

from __future__ import annotations

__version__ = "0.1.0"

from pipecut.errors import (  # noqa: E402
    CaptureError,
    InputError,
    PartitionError,
    PipecutError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
)
from pipecut.plan import (  # noqa: E402
    CaptureMethod,
    DeviceSpec,
    Link,
    Plan,
    Recompute,
    ScheduleKind,
)
from pipecut.planner import plan  # noqa: E402
from pipecut.api import compile  # noqa: E402
from pipecut.render import render  # noqa: E402

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
    "plan",
    "render",
]
