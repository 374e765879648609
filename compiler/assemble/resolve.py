"""What ``compile`` hands the runtime so a plan runs other shapes: wire specs and schedules.

The runtime may not import passes, and propagation is a pass; so the API layer builds these
callables and the runtime only calls them. Both are deterministic functions of what every rank
has (the captured graph, the plan, the microbatch's signature), cached per key, so ranks agree
without a handshake.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.fx as fx

from pipecut.core.shapes import Signature, accepted, describe_accepted, planned_signature
from pipecut.errors import InputError, ScheduleError
from pipecut.ir import NodeCost, Plan
from pipecut.options import schedule_origin
from pipecut.passes.costs.stages import plan_costs
from pipecut.passes.rewrite.propagate import PropagationError, cut_values
from pipecut.schedules.format import Schedule, validate
from pipecut.schedules.standard import build

__all__: list[str] = []

MAX_CACHED = 1024
"""Distinct microbatch signatures kept (sequence lengths x microbatch sizes x autocast states)."""


class WireSpecs:
    """Signature -> the spec (:class:`NodeCost` with leaves) of every cut value, cached.

    The planned signature without autocast uses the plan's own rows (exactly the former
    behaviour, and no propagation, so models whose graph cannot run on fake tensors still run
    their planned shapes). Any other signature propagates fake tensors through the captured
    graph (``pipecut.passes.rewrite.propagate``); one that cannot propagate is refused.
    """

    def __init__(self, gm: fx.GraphModule, plan: Plan, device: torch.device) -> None:
        self.gm = gm
        self.plan = plan
        self.device = device
        self._planned = planned_signature(plan)
        self._cache: dict[Signature, Mapping[str, NodeCost] | None] = {}

    def __call__(self, sig: Signature, flat: Sequence[Any]) -> Mapping[str, NodeCost] | None:
        if sig in self._cache:
            return self._cache[sig]
        if sig == self._planned:
            specs = None
        else:
            try:
                specs = cut_values(self.gm, self.plan, flat, device=self.device, autocast=sig.autocast)
            except PropagationError as e:
                shapes = [p for p in sig.inputs if isinstance(p, tuple)]
                raise InputError(
                    f"microbatch inputs {shapes} ({sig.autocast}) do not run through "
                    f"the captured graph: {e}. This plan accepts {describe_accepted(accepted(self.plan))}; "
                    f"pass the planned shapes or re-plan with example inputs of these shapes"
                ) from e
        if len(self._cache) >= MAX_CACHED:
            self._cache.pop(next(iter(self._cache)))
        self._cache[sig] = specs
        return specs


def schedules(plan: Plan) -> Any:
    """Microbatch count -> the plan's kind of schedule for that many (a smaller last batch
    may have fewer microbatches than planned), validated, cached."""

    @lru_cache(maxsize=16)
    def schedule_for(microbatches: int) -> Schedule:
        try:
            sched = build(plan.schedule, plan.num_ranks, microbatches, plan.stages_per_rank,
                          plan_costs(plan))
            validate(sched, microbatches, plan.schedule.placement)
        except (ScheduleError, ValueError) as e:
            raise InputError(
                f"a batch that splits into {microbatches} microbatches cannot run the "
                f"{plan.schedule.value} schedule{schedule_origin(plan.options)}: {e}; pass a batch of at least "
                f"{plan.microbatches} samples or drop the last batch"
            ) from e
        return sched

    return schedule_for
