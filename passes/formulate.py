"""From a cost table to a :class:`~pipecut.passes.problem.Problem` over the unit chain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.parallel import DataParallel
from pipecut.passes.chain import Liveness, boundary_bytes, boundary_ms, liveness
from pipecut.passes.holders import holds_params
from pipecut.passes.problem import Problem
from pipecut.passes.stages import inflight_microbatches, state_bytes
from pipecut.plan import DeviceSpec, Link, NodeCost, NodeOp, ScheduleKind

__all__ = ["Formulation", "formulate", "unit_fixed_bytes"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Formulation:
    problem: Problem
    live: Liveness
    modules: tuple[str, ...]
    """Module path of each unit, for coarsening at module boundaries."""


def unit_fixed_bytes(node: NodeCost, by_name: dict[str, NodeCost], data_parallel: DataParallel | None = None) -> int:
    """Parameters, gradients and optimizer state of a unit and the ``get_attr`` nodes it reads.

    A parameter read by two units of one stage is counted twice here (once in the plan), so the
    memory the solvers see is never below what the plan reports.
    """
    params = node.param_bytes + sum(
        by_name[i].param_bytes for i in node.inputs if by_name[i].op is NodeOp.GET_ATTR
    )
    return state_bytes(params, data_parallel)


def formulate(
    nodes: Sequence[NodeCost],
    *,
    devices: Sequence[DeviceSpec],
    link: Link,
    schedule: ScheduleKind,
    microbatches: int,
    recompute: bool,
    data_parallel: DataParallel | None = None,
) -> Formulation:
    live = liveness(nodes)
    fwd_bytes, bwd_bytes, allowed = boundary_bytes(nodes, live)
    by_name = {n.name: n for n in nodes}
    units = [by_name[u] for u in live.units]
    k = len(devices)
    problem = Problem(
        names=live.units,
        compute_ms=tuple(u.forward_ms + u.backward_ms for u in units),
        forward_ms=tuple(u.forward_ms for u in units),
        boundary_ms=tuple(boundary_ms(fwd_bytes, bwd_bytes, allowed, link)),
        input_bytes=tuple(fwd_bytes),
        fixed_bytes=tuple(unit_fixed_bytes(u, by_name, data_parallel) for u in units),
        activation_bytes=tuple(u.output_bytes for u in units),
        speeds=tuple(d.speed for d in devices),
        capacities=tuple(d.memory_bytes for d in devices),
        inflight=tuple(inflight_microbatches(schedule, k, microbatches)),
        recompute=recompute,
        holds_params=holds_params(nodes, live.units),
    )
    return Formulation(problem=problem, live=live, modules=tuple(u.module for u in units))
