"""pipecut: a graph-partitioning compiler for pipeline-parallel training in PyTorch.

The public surface is ``__all__`` below, plus the subpackages :mod:`pipecut.passes` (pure
passes: ``plan_hybrid``, ``workload``, ...) and :mod:`pipecut.runtime` (``Pipeline``,
checkpoints, schedules). Every module declares its own ``__all__``.
"""

from __future__ import annotations

import logging

from pipecut.api import compile
from pipecut.cluster import Link
from pipecut.core.kinds import CaptureMethod, Partitioner, Recompute, ScheduleKind, TensorShard
from pipecut.errors import (
    CaptureError,
    InputError,
    PartitionError,
    PipecutError,
    PipelineRuntimeError,
    PlanError,
    ScheduleError,
)
from pipecut.ir import DeviceSpec, NodeCost, Plan
from pipecut.options import (
    CaptureOptions,
    DataParallelOptions,
    IlpSolver,
    LossReduction,
    MeasureOptions,
    Options,
    PartitionOptions,
    RuntimeOptions,
    ScheduleOptions,
    TensorParallelOptions,
    WeightOptions,
)
from pipecut.passes.partition.solve import partition_costs
from pipecut.planning.planner import plan
from pipecut.planning.replicas import choose_replicas
from pipecut.profile.devices import device_link, device_profiles, device_specs, estimate_costs
from pipecut.report.render import render
from pipecut.report.text import summary
from pipecut.version import __version__

# A library logs and leaves the output to the application (`pipecut` the CLI configures it).
logging.getLogger("pipecut").addHandler(logging.NullHandler())

__all__ = [
    "CaptureError",
    "CaptureMethod",
    "CaptureOptions",
    "DataParallelOptions",
    "DeviceSpec",
    "IlpSolver",
    "InputError",
    "Link",
    "LossReduction",
    "MeasureOptions",
    "NodeCost",
    "Options",
    "PartitionError",
    "PartitionOptions",
    "Partitioner",
    "PipecutError",
    "PipelineRuntimeError",
    "Plan",
    "PlanError",
    "Recompute",
    "RuntimeOptions",
    "ScheduleError",
    "ScheduleKind",
    "ScheduleOptions",
    "TensorParallelOptions",
    "TensorShard",
    "WeightOptions",
    "__version__",
    "choose_replicas",
    "compile",
    "device_link",
    "device_profiles",
    "device_specs",
    "estimate_costs",
    "partition_costs",
    "plan",
    "render",
    "summary",
]
