"""Errors pipecut promises. Each names the node, stage or rank involved, the values, and the fix.

User mistakes are ``ValueError``/``TypeError`` subclasses so callers can catch them the usual
way; mismatches discovered while running are ``RuntimeError`` subclasses.
"""

from __future__ import annotations

__all__ = [
    "CaptureError",
    "InputError",
    "PartitionError",
    "PipecutError",
    "PipelineRuntimeError",
    "PlanError",
    "ScheduleError",
]


class PipecutError(Exception):
    """Base class of every error raised by pipecut."""


class CaptureError(PipecutError, ValueError):
    """The model could not be captured as a graph by any of the methods tried."""


class InputError(PipecutError, TypeError):
    """Example inputs, targets or step inputs are not of the form pipecut accepts."""


class PartitionError(PipecutError, ValueError):
    """The graph cannot be split as asked (too many stages, nothing fits in memory, …)."""


class PlanError(PipecutError, ValueError):
    """A plan file is corrupt, of an unknown version, or made for another model."""


class ScheduleError(PipecutError, ValueError):
    """A schedule is malformed or would deadlock."""


class PipelineRuntimeError(PipecutError, RuntimeError):
    """A rank failed, timed out, or received data that does not match the plan."""
