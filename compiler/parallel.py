"""Data parallelism across pipeline replicas, as plan data: which engine, how many replicas.

Imported by the planner's memory model (``pipecut.passes.costs.stages.state_bytes``) and by the
runtime (``pipecut.runtime.grads.data_parallel``), so it sits with the plan data, below both.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipecut.core.choices import enum_choice
from pipecut.core.kinds import DataParallelKind
from pipecut.errors import InputError

__all__ = ["DataParallel", "as_data_parallel"]


@dataclass(frozen=True, kw_only=True, slots=True)
class DataParallel:
    kind: DataParallelKind
    replicas: int
    """Replicas of every stage (the size of the mesh's "dp" dimension)."""

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise InputError(f"data parallelism needs at least 1 replica, got {self.replicas}")


def as_data_parallel(value: str | DataParallelKind) -> DataParallelKind:
    """``"ddp"``/``"fsdp"`` (any case) or the enum; anything else is refused with the options."""
    return enum_choice(DataParallelKind, value, "data_parallel")
