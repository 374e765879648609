"""What a built pipeline holds, as one frozen record: the build's result, from which a
:class:`~pipecut.runtime.pipeline.Pipeline` is made.

``pipecut.compile`` builds this rank's stages step by step (capture, plan, split, weights, the
tensor group), and each step hands its result down; the record is the last of them. The two
steps that come after a first build return new records instead of changing a pipeline:

- :func:`recosted`: live calibration gave the same stages other costs (and, for a
  zero-bubble order list scheduled on them, another schedule);
- :func:`replicated`: the stages wrapped over their replica group (DDP, ZeRO-1, FSDP2).

A :class:`~pipecut.runtime.pipeline.Pipeline` holds the record and the state that changes while
it trains (the mode, the last step's timeline, the ``no_sync`` flag); nothing sets its
attributes from outside.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch.distributed as dist

from pipecut.core.graph import canonical_names
from pipecut.core.program import Captured
from pipecut.core.shapes import Signature
from pipecut.errors import PipelineRuntimeError
from pipecut.ir import NodeCost, Plan
from pipecut.runtime.execution.forward import ModeSwitch
from pipecut.runtime.execution.stage import StageWorker
from pipecut.runtime.grads.collective import LossReduction
from pipecut.runtime.grads.data_parallel import Replication
from pipecut.schedules.format import Action, Schedule

WireResolver = Callable[[Signature, Sequence[Any]], Mapping[str, NodeCost] | None]
"""Signature of a microbatch (and its flat inputs) -> every cut value's spec for it; None
where the plan's own apply. Deterministic, so every rank derives the same specs without
exchanging them."""
ScheduleResolver = Callable[[int], Schedule]
"""Number of microbatches -> the schedule (a smaller last batch may have fewer than planned)."""
Timeline = tuple[tuple[Action, float, float], ...]
"""The plan's predicted (action, start ms, end ms) of every rank's actions."""

__all__ = [
    "BuiltPipeline", "Groups", "ScheduleResolver", "Timeline", "WireResolver", "parameter_aliases", "recosted",
    "replicated",
]


@dataclasses.dataclass(frozen=True)
class Groups:
    """The process groups this rank's stages talk over."""

    pipeline: dist.ProcessGroup | None
    """The ranks of this rank's pipeline (None: the default group)."""
    tied: tuple[tuple[str, dist.ProcessGroup | None], ...] = ()
    """Per tied weight whose stages sit on several ranks: its name and the group of those ranks."""
    data_parallel: dist.ProcessGroup | None = None
    """The ranks holding the same stages in the other replicas (a "dp" dimension), or None."""
    tensor: dist.ProcessGroup | None = None
    """The ranks that split this rank's stages between them (a "tp" dimension), or None."""
    state: dist.ProcessGroup | None = None
    """With tensor parallelism: the ranks holding one copy of the model (every stage, every
    shard), over which checkpoints are written and read; None: the pipeline group."""


@dataclasses.dataclass(frozen=True)
class BuiltPipeline:
    """This rank's share of a pipeline, as the build left it."""

    plan: Plan
    captured: Captured
    """The captured graph the stages were split from (its names, inputs and outputs)."""
    workers: Mapping[int, StageWorker]
    """This rank's stages in the captured mode, by stage index (several with interleaving);
    each holds its program and, with ``compile_stages``, its compiled state."""
    schedule: Schedule
    rank: int
    """This rank's index in the pipeline group."""
    ranks: tuple[int, ...]
    """The pipeline group's global ranks, by pipeline rank."""
    groups: Groups
    aliases: Mapping[str, str]
    """Every parameter name of the captured graph -> the first name of its tensor, read at
    build: FSDP later swaps parameters for sharded ones on modules shared with the graph, after
    which the tie between two names is no longer visible."""
    loss_reduction: LossReduction = LossReduction.MEAN
    modes: ModeSwitch | None = None
    """The train and eval stage programs (None: one set of programs for both)."""
    wire: WireResolver | None = None
    schedule_for: ScheduleResolver | None = None
    predicted: Timeline = ()
    timeout: datetime.timedelta = datetime.timedelta(seconds=300)
    replication: Replication | None = None
    """The data-parallel wrappers of this rank's stages (see :func:`replicated`), or None."""

    def __post_init__(self) -> None:
        if not self.workers:
            raise PipelineRuntimeError(f"rank {self.rank}: a pipeline rank with no stage (a pipecut bug)")
        for name in ("workers", "aliases"):  # read-only views; a replace keeps the same view
            if not isinstance(getattr(self, name), MappingProxyType):
                object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "ranks", tuple(self.ranks))
        object.__setattr__(self, "predicted", tuple(self.predicted))


def parameter_aliases(captured: Captured) -> dict[str, str]:
    """Every parameter name of ``captured``'s graph -> the first name of the same tensor."""
    first = canonical_names(captured.gm)
    return {name: first[id(p)] for name, p in captured.gm.named_parameters(remove_duplicate=False)}


def recosted(built: BuiltPipeline, plan: Plan, schedule: Schedule, schedule_for: ScheduleResolver,
             predicted: Sequence[tuple[Action, float, float]]) -> BuiltPipeline:
    """``built`` with ``plan``, its stages with other costs (live calibration), and the schedule
    built on them. A zero-bubble order is list scheduled on the costs, so it can move with them;
    the pipeline runs the order its plan replays, or a resumed run would sum gradients in
    another order than the run it resumes."""
    if not plan.runs_like(built.plan):
        raise PipelineRuntimeError(
            f"rank {built.rank}: a plan of other stages cannot replace this pipeline's "
            f"(stages {sorted(built.workers)}); build it with pipecut.compile (a pipecut bug if compile got here)"
        )
    return dataclasses.replace(built, plan=plan, schedule=schedule, schedule_for=schedule_for,
                               predicted=tuple(predicted))


def replicated(built: BuiltPipeline, replication: Replication, modes: ModeSwitch | None) -> BuiltPipeline:
    """``built`` with its stages wrapped over their replica group, and the train/eval programs
    that still run under the wrappers (``modes``: FSDP2 swaps parameters, so a separate
    mode's programs may have been dropped)."""
    if built.replication is not None:
        raise PipelineRuntimeError(f"rank {built.rank}: the stages are wrapped for data parallelism already "
                                   f"(a pipecut bug)")
    return dataclasses.replace(built, replication=replication, modes=modes)
