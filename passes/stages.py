"""Turn a split of the unit chain into the plan's stages, cut edges, tied groups and prediction.

Pure data in, pure data out: everything here reads the cost table, never a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipecut.passes.chain import Liveness, boundary_bytes, boundary_ms, value_bytes
from pipecut.plan import (
    DeviceSpec,
    Edge,
    Link,
    NodeCost,
    NodeOp,
    Plan,
    Predicted,
    Recompute,
    ScheduleKind,
    Stage,
    TiedGroup,
)
from pipecut.runtime.schedule import Action, simulate, timeline
from pipecut.runtime.schedule import build as build_schedule

OPTIMIZER_STATE_FACTOR = 2
"""Optimizer state per parameter byte (AdamW keeps two moments)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StageFacts:
    stages: tuple[Stage, ...]
    edges: tuple[Edge, ...]
    tied: tuple[TiedGroup, ...]
    predicted: Predicted


def inflight_microbatches(schedule: ScheduleKind, stages: int, microbatches: int) -> list[int]:
    """How many microbatches' activations each stage holds at its peak."""
    if schedule is ScheduleKind.GPIPE:
        return [microbatches] * stages
    return [min(microbatches, stages - s) for s in range(stages)]


def stage_params(units: Sequence[NodeCost], by_name: dict[str, NodeCost]) -> tuple[tuple[str, ...], int]:
    """Canonical parameter FQNs a group of units reads, and their bytes (each source once)."""
    fqns: dict[str, None] = {}
    sources: dict[tuple[NodeOp, str], int] = {}
    for u in units:
        readers = [u] + [by_name[i] for i in u.inputs if by_name[i].op is NodeOp.GET_ATTR]
        for r in readers:
            if r.parameters:
                fqns.update(dict.fromkeys(r.parameters))
                sources[(r.op, r.target)] = r.param_bytes
    return tuple(fqns), sum(sources.values())


def build_stages(
    nodes: Sequence[NodeCost],
    live: Liveness,
    bounds: Sequence[int],
    *,
    devices: Sequence[DeviceSpec],
    link: Link,
    schedule: ScheduleKind,
    microbatches: int,
    recompute: Sequence[Recompute] | None = None,
    stages_per_rank: int = 1,
) -> StageFacts:
    k = len(bounds) - 1
    by_name = {n.name: n for n in nodes}
    fwd, bwd, allowed = boundary_bytes(nodes, live)
    cut_ms = boundary_ms(fwd, bwd, allowed, link)
    inflight = inflight_microbatches(schedule, k, microbatches)
    recompute = list(recompute) if recompute is not None else [Recompute.NONE] * k
    stage_of = {name: s for s in range(k) for name in live.units[bounds[s] : bounds[s + 1]]}

    stages = []
    for s in range(k):
        units = [by_name[u] for u in live.units[bounds[s] : bounds[s + 1]]]
        inputs = tuple(live.crossing(bounds[s]))
        outputs = tuple(live.crossing(bounds[s + 1]))
        fqns, pbytes = stage_params(units, by_name)
        speed = devices[s].speed
        fwd_ms = sum(u.forward_ms for u in units) / speed
        bwd_ms = sum(u.backward_ms for u in units) / speed
        in_bytes = sum(value_bytes(by_name[v])[0] for v in inputs)
        if recompute[s] is Recompute.FULL:
            act = in_bytes  # only the stage inputs are kept; the rest is recomputed in backward
            bwd_ms += fwd_ms
        else:
            act = in_bytes + sum(u.output_bytes for u in units)
        fixed = pbytes * (2 + OPTIMIZER_STATE_FACTOR)
        stages.append(
            Stage(
                index=s,
                device=devices[s].name,
                nodes=tuple(u.name for u in units),
                parameters=fqns,
                recompute=recompute[s],
                forward_ms=fwd_ms,
                backward_ms=bwd_ms,
                comm_ms=cut_ms[bounds[s]] + cut_ms[bounds[s + 1]],
                param_bytes=pbytes,
                activation_bytes=act,
                peak_memory_bytes=fixed + inflight[s] * act,
                send_bytes=fwd[bounds[s + 1]] if s < k - 1 else 0,
                recv_bytes=fwd[bounds[s]] if s > 0 else 0,
                inputs=inputs,
                outputs=outputs,
            )
        )

    users: dict[str, list[str]] = {}
    for n in nodes:
        for src in n.inputs:
            users.setdefault(src, []).append(n.name)
    edges = []
    for name in live.units:
        consumers = {stage_of[c] for c in users.get(name, ()) if c in stage_of} - {stage_of[name]}
        if consumers:
            node = by_name[name]
            edges.append(
                Edge(
                    src_node=name,
                    src_stage=stage_of[name],
                    dst_stages=tuple(sorted(consumers)),
                    shape=node.shape,
                    dtype=node.dtype,
                    bytes=value_bytes(node)[0],
                )
            )

    owners: dict[str, set[int]] = {}
    for st in stages:
        for fqn in st.parameters:
            owners.setdefault(fqn, set()).add(st.index)
    tied = tuple(
        TiedGroup(fqn=fqn, stages=tuple(sorted(ss))) for fqn, ss in owners.items() if len(ss) > 1
    )
    return StageFacts(
        stages=tuple(stages),
        edges=tuple(edges),
        tied=tied,
        predicted=predict(
            stages,
            microbatches,
            nodes,
            schedule,
            *link_times(stages, nodes, link),
            stages_per_rank=stages_per_rank,
        ),
    )


def predict(
    stages: Sequence[Stage],
    microbatches: int,
    nodes: Sequence[NodeCost],
    schedule: ScheduleKind,
    forward_link_ms: Sequence[float] = (),
    backward_link_ms: Sequence[float] = (),
    stages_per_rank: int = 1,
) -> Predicted:
    """Step time of the schedule, simulated action by action on the per-stage costs.

    ``forward_link_ms[s]`` / ``backward_link_ms[s]``: transfer time of the cut between stage s
    and s + 1, activations forward and gradients backward.
    """
    k = len(stages)
    ranks = k // stages_per_rank
    sched = build_schedule(schedule, ranks, microbatches, stages_per_rank)
    forward = [s.forward_ms for s in stages]
    backward = [s.backward_ms for s in stages]
    step = simulate(sched, forward, backward, forward_link_ms, backward_link_ms)
    busy = microbatches * sum(f + b for f, b in zip(forward, backward))
    stage_ms = tuple(s.time_ms for s in stages)
    return Predicted(
        step_ms=step,
        bubble_fraction=max(0.0, 1.0 - busy / (ranks * step)) if step > 0 else 0.0,
        bottleneck_stage=max(range(k), key=lambda s: stage_ms[s]),
        stage_ms=stage_ms,
        single_device_ms=microbatches * sum(n.forward_ms + n.backward_ms for n in nodes),
    )


def link_times(stages: Sequence[Stage], nodes: Sequence[NodeCost], link: Link) -> tuple[list[float], list[float]]:
    """Per cut between stage s and s + 1: (activation transfer ms, gradient transfer ms)."""
    by_name = {n.name: n for n in nodes}
    forward, backward = [], []
    for st in stages[:-1]:
        sizes = [value_bytes(by_name[v]) for v in st.outputs]
        forward.append(link.transfer_ms(sum(f for f, _ in sizes)))
        backward.append(link.transfer_ms(sum(b for _, b in sizes)))
    return forward, backward


def predicted_timeline(plan: Plan) -> list[tuple[Action, float, float]]:
    """The simulator's (action, start ms, end ms) for the plan's schedule and stage costs."""
    forward, backward = link_times(plan.stages, plan.nodes, plan.link)
    return timeline(
        build_schedule(plan.schedule, plan.num_ranks, plan.microbatches, plan.stages_per_rank),
        [s.forward_ms for s in plan.stages],
        [s.backward_ms for s in plan.stages],
        forward,
        backward,
    )
