"""What ``plan`` or ``compile`` was asked: the model, its inputs, the devices and the options.

``pipecut.plan`` and ``pipecut.compile`` each resolve their arguments once into a
:class:`Request`; every planning step (auto choices, replicas, a cluster, one fixed plan) and
every build step reads it, instead of threading two dozen keyword arguments through each.
Compile's rank 0 hands the planner its own request, with the devices resolved and the options
it plans with. :class:`FirstBatch` is the microbatch a fixed plan is captured and measured on.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from pipecut.capture import capture_as
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.meta import input_device
from pipecut.core.program import Captured, Inputs
from pipecut.ir import DeviceSpec, NodeCost, Plan
from pipecut.options import DataParallelOptions, Options, WeightOptions
from pipecut.passes.partition.solve import DEFAULT_LINK
from pipecut.profile.devices import estimate_table
from pipecut.profile.nodes import LossFn, profile
from pipecut.report.text import sequential_note

__all__ = ["FirstBatch", "Request", "capture_at", "profile_at", "warn_if_sequential"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """What ``pipecut.plan`` or ``pipecut.compile`` was asked, its options resolved (the same
    on every rank): read by every step, never changed (a step that plans or builds a variant
    makes a new one with :meth:`with_options` or ``dataclasses.replace``)."""

    model: torch.nn.Module
    example_inputs: Inputs
    target: Any
    loss_fn: LossFn | None
    devices: Any
    """The devices as given: a count, device names or :class:`~pipecut.ir.DeviceSpec` s, a
    DeviceMesh (``compile``), or None (``compile``: one stage per rank of the default group)."""
    specs: tuple[DeviceSpec, ...] = ()
    """The devices the planner partitions over, resolved: ``plan`` resolves ``devices`` at
    once, ``compile`` fills them from where its ranks sit before rank 0 plans (empty until
    then, and for a cluster plan)."""
    options: Options
    weights: WeightOptions = field(default_factory=WeightOptions)
    """Where a meta model's weights come from (``compile``)."""
    given: Plan | None = None
    """The plan to replay (``compile(plan=...)``), or None to plan."""
    remeasure: bool = False
    """A rebuild after live calibration moved the split: time it again, keep its split."""
    progress: Callable[[int, int], None] | None = None
    unasked: tuple[tuple[str, str], ...] = ()
    """Option groups this call did not pass, each with where its value came from instead
    (``("runtime", "recorded in the replayed plan's options")``, ``("data_parallel", "chosen by
    data_parallel='auto'")``): a refusal names what the user asked for, not a value they never
    saw (:meth:`whence`)."""

    def with_options(self, **groups: Any) -> Request:
        """This request with some options replaced (``microbatches=4``, ``measure=...``)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **groups))

    def whence(self, group: str) -> str:
        """Where an option group of :attr:`unasked` got its value ("recorded in the replayed plan's
        options"), for a refusal to say after the value; empty for one this call passed (or left
        at its default)."""
        return next((why for name, why in self.unasked if name == group), "")

    @property
    def wait(self) -> datetime.timedelta:
        """How long a rank waits for another (``RuntimeOptions.timeout``)."""
        return datetime.timedelta(seconds=self.options.runtime.timeout)

    @property
    def link(self) -> Any:
        return self.options.measure.fixed_link or DEFAULT_LINK

    @property
    def replication(self) -> DataParallelOptions | None:
        """The replicas asked for as a plan records them; None unless kind and replicas are
        both given."""
        dp = self.options.data_parallel
        return dp if dp.is_resolved else None

    @property
    def stages_per_rank(self) -> int:
        return self.options.scheduling.stages_per_rank or 1

    @property
    def here(self) -> torch.device:
        """Where the example inputs are."""
        return input_device(self.example_inputs)

    @property
    def measure_on(self) -> torch.device:
        """Where nodes are timed: the asked device, else where the inputs are."""
        device = self.options.measure.device
        return torch.device(device) if device is not None else self.here


@dataclass(frozen=True, kw_only=True, slots=True)
class FirstBatch:
    """The first of M microbatches of the request's batch: what a plan is captured and timed on."""

    batch_size: int
    """The whole batch's size."""
    inputs: Inputs
    target: Any

    @classmethod
    def of(cls, request: Request, microbatches: int) -> FirstBatch:
        size, inputs = first_microbatch(request.example_inputs, microbatches)
        target = request.target
        first_target = split_microbatches(target, microbatches, size, "target")[0] if target is not None else None
        return cls(batch_size=size, inputs=inputs, target=first_target)

    def flat(self, captured: Captured) -> list[Any]:
        """The inputs as ``captured``'s placeholders take them."""
        return list(captured.flatten_inputs(self.inputs))


def capture_at(request: Request, inputs: Inputs) -> Captured:
    """The request's model captured on ``inputs`` (one microbatch) as its options say."""
    return capture_as(request.model, inputs, request.options.capture)


def profile_at(request: Request, captured: Captured, inputs: Inputs, target: Any, *,
               progress: Callable[[int, int], None] | None = None,
               only: Collection[str] | None = None) -> tuple[NodeCost, ...]:
    """``captured``'s cost table on ``inputs`` (one microbatch), timed as the request's
    measurement options say, where they say (see :func:`pipecut.profile.nodes.profile`), or,
    with ``MeasureOptions(estimate=...)``, estimated for that device without reading a clock
    (every node: ``only`` and ``progress`` go unused)."""
    measure = request.options.measure
    if measure.estimate is not None:
        return estimate_table(captured, captured.flatten_inputs(inputs), measure.estimate,
                              loss_fn=request.loss_fn, target=target)
    return profile(captured, captured.flatten_inputs(inputs), loss_fn=request.loss_fn, target=target,
                   repeats=measure.repeats, warmup=measure.warmup, progress=progress,
                   device=request.measure_on, only=only)


def warn_if_sequential(p: Plan) -> Plan:
    """Log a warning when ``p`` cannot pipeline: one microbatch on several ranks runs the
    stages one after another, K devices doing the work of one. Returns ``p``."""
    note = sequential_note(p)
    if note:
        log.warning("%s", note)
    return p
