"""The cost rules (state bytes, in-flight microbatches, the ring all-reduce) and the plan's stages.

Pure data in, pure data out: everything here reads the cost table, never a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from pipecut.cluster import Link
from pipecut.core.kinds import DataParallelKind, NodeOp, Recompute, ScheduleKind
from pipecut.ir import DeviceSpec, Edge, NodeCost, Plan, Predicted, Stage, TiedGroup
from pipecut.options import DataParallelOptions
from pipecut.passes.partition.chain import (
    Liveness,
    boundary_bytes,
    boundary_messages,
    boundary_ms,
    param_readers,
    reads_params,
    value_bytes,
    value_messages,
)
from pipecut.schedules.format import Action, Placement, Schedule, rank_of
from pipecut.schedules.simulate import StageCosts, rank_end_ms, timeline
from pipecut.schedules.standard import build as build_schedule

__all__ = [
    "OPTIMIZER_STATE_FACTOR",
    "StageFacts",
    "build_stages",
    "inflight_microbatches",
    "plan_costs",
    "plan_schedule",
    "predict",
    "predicted_timeline",
    "replica_sync_ms",
    "ring_allreduce_ms",
    "ring_ms",
    "stage_costs",
    "stage_params",
]

OPTIMIZER_STATE_FACTOR = 2
"""Optimizer state per parameter byte (AdamW keeps two moments)."""


def state_bytes(param_bytes: int, data_parallel: DataParallelOptions | None = None) -> int:
    """Peak bytes of parameters, gradients and optimizer state for ``param_bytes`` of parameters.

    Replicated (one pipeline, or DDP): all of it on every replica. ZeRO-1: parameters and
    gradients whole, the optimizer state a D-th (rounded up: torch's ZeroRedundancyOptimizer
    partitions whole tensors, largest first, so a replica can hold a little more). FSDP shards
    a stage as one ``fully_shard`` unit gathered for the whole step, so at the step's peak a
    replica holds the gathered parameters and the unsharded gradients they accumulate over the
    microbatches, plus its 1/D shard of parameters, gradients and optimizer state, which is all
    it keeps between steps. (FSDP's transient reduce-scatter buffer is not counted.) Under
    pipelining ZeRO-1's peak is the lower of the two sharded kinds: FSDP's working copies are
    whole during the step too.
    """
    kind = data_parallel.kind if data_parallel is not None else None
    if kind is None or kind is DataParallelKind.DDP:
        return param_bytes * (2 + OPTIMIZER_STATE_FACTOR)
    d = data_parallel.resolved_replicas if data_parallel is not None else 1
    if kind is DataParallelKind.ZERO1:
        return 2 * param_bytes + -(-param_bytes * OPTIMIZER_STATE_FACTOR // d)
    shard = -(-param_bytes * (2 + OPTIMIZER_STATE_FACTOR) // d)
    return 2 * param_bytes + shard


def replica_sync_ms(nbytes: float, replicas: int, link: Link, kind: DataParallelKind = DataParallelKind.DDP) -> float:
    """A stage's collectives over its replicas once per step, as pipecut's runtime runs them:
    DDP all-reduces the gradients; FSDP2 gathers the parameters once and reduce-scatters the
    gradients once (the same ring traffic); ZeRO-1 all-reduces as DDP does and then each
    replica broadcasts the parameters it updated, one all-gather's worth more (half an
    all-reduce): 1.5 times DDP's."""
    reduce = ring_allreduce_ms(nbytes, replicas, link)
    return 1.5 * reduce if kind is DataParallelKind.ZERO1 else reduce


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
        for r in param_readers(u, by_name):
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
    recomputed: Sequence[tuple[str, ...]] | None = None,
    stages_per_rank: int = 1,
    data_parallel: DataParallelOptions | None = None,
) -> StageFacts:
    """The stages of the cut at ``bounds``, the values crossing stages, the parameters several
    stages read, and the predicted step."""
    k = len(bounds) - 1
    fwd, bwd, allowed = boundary_bytes(nodes, live)
    cut = _Cut(
        by_name={n.name: n for n in nodes}, live=live, bounds=bounds, fwd=fwd, bwd=bwd,
        cut_ms=boundary_ms(fwd, bwd, allowed, link, boundary_messages(nodes, live)),
    )
    inflight = inflight_microbatches(schedule, k, microbatches)
    recompute = list(recompute) if recompute is not None else [Recompute.NONE] * k
    recomputed = list(recomputed) if recomputed is not None else [()] * k
    stages = [
        _stage(cut, s, devices[s], recompute[s], tuple(recomputed[s]),
               inflight[s], data_parallel)
        for s in range(k)
    ]
    return StageFacts(
        stages=tuple(stages),
        edges=_edges(nodes, cut),
        tied=_tied(stages),
        predicted=predict(stages, microbatches, nodes, schedule, link, stages_per_rank, data_parallel),
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Cut:
    """What every stage of one cut reads: the nodes by name, the liveness, the cut positions,
    and per cut position the activation and gradient bytes and the communication time."""

    by_name: dict[str, NodeCost]
    live: Liveness
    bounds: Sequence[int]
    fwd: Sequence[int]
    bwd: Sequence[int]
    cut_ms: Sequence[float]

    def units(self, s: int) -> list[NodeCost]:
        return [self.by_name[u] for u in self.live.units[self.bounds[s] : self.bounds[s + 1]]]


def _stage(
    cut: _Cut,
    s: int,
    device: DeviceSpec,
    recompute: Recompute,
    recomputed: tuple[str, ...],
    inflight: int,
    data_parallel: DataParallelOptions | None,
) -> Stage:
    """Stage s of the cut, its times on ``device`` and its memory with ``inflight`` microbatches."""
    a, e, k = cut.bounds[s], cut.bounds[s + 1], len(cut.bounds) - 1
    units = cut.units(s)
    inputs = tuple(cut.live.crossing(a))
    fqns, pbytes = stage_params(units, cut.by_name)
    fwd_ms, bwd_ms, wgt_ms = _compute_ms(cut, s, units, device.speed)
    act, bwd_ms = _recompute(cut, s, units, inputs, recompute, recomputed, device.speed, bwd_ms)
    return Stage(
        index=s,
        device=device.name,
        nodes=tuple(u.name for u in units),
        parameters=fqns,
        recompute=recompute,
        recomputed=recomputed,
        forward_ms=fwd_ms,
        backward_ms=bwd_ms,
        # a split backward recomputes once, in the input pass (held_recompute): W is the weights' share
        weight_ms=wgt_ms,
        comm_ms=cut.cut_ms[a] + cut.cut_ms[e],
        param_bytes=pbytes,
        activation_bytes=act,
        peak_memory_bytes=state_bytes(pbytes, data_parallel) + inflight * act,
        send_bytes=cut.fwd[e] if s < k - 1 else 0,
        recv_bytes=cut.fwd[a] if s > 0 else 0,
        inputs=inputs,
        outputs=tuple(cut.live.crossing(e)),
    )


def _compute_ms(cut: _Cut, s: int, units: Sequence[NodeCost], speed: float) -> tuple[float, float, float]:
    """Stage s's forward, backward and weight-gradient times at ``speed``, before recompute."""
    fwd_ms = sum(u.forward_ms for u in units) / speed
    bwd_ms = sum(u.backward_ms for u in units) / speed
    # dW and dX of a product cost the same: half the backward of a node reading weights.
    # A stage no gradient leaves (the first: its inputs are data) has no dX to hand on, so
    # a split backward's I does nothing there and W is the whole backward.
    wgt_ms = sum(u.backward_ms for u in units if reads_params(u, cut.by_name)) / (2 * speed)
    if cut.bwd[cut.bounds[s]] == 0:
        wgt_ms = bwd_ms
    return fwd_ms, bwd_ms, wgt_ms


def _recompute(
    cut: _Cut,
    s: int,
    units: Sequence[NodeCost],
    inputs: Sequence[str],
    recompute: Recompute,
    recomputed: Sequence[str],
    speed: float,
    bwd_ms: float,
) -> tuple[int, float]:
    """Bytes stage s keeps per microbatch for its backward, and its backward time ``bwd_ms``
    plus the forward it recomputes in place of what it did not keep."""
    in_bytes = sum(value_bytes(cut.by_name[v])[0] for v in inputs)
    if recompute is Recompute.FULL:
        # only the stage inputs are kept; the rest is recomputed in backward
        return in_bytes, bwd_ms + sum(u.forward_ms for u in units) / speed
    act = in_bytes + sum(u.kept_bytes for u in units)
    for a, e in _runs(sorted(cut.live.index[n] for n in recomputed)):  # SELECTIVE's blocks
        block = [cut.by_name[u] for u in cut.live.units[a:e]]
        act -= sum(u.kept_bytes for u in block) - (cut.fwd[a] if a > cut.bounds[s] else 0)
        bwd_ms += sum(u.forward_ms for u in block) / speed
    return act, bwd_ms


def _edges(nodes: Sequence[NodeCost], cut: _Cut) -> tuple[Edge, ...]:
    """One edge per value that stages other than its own read (a rebuilt value crosses no
    cut: the stages that read it compute it again)."""
    bounds, units = cut.bounds, cut.live.units
    stage_of = {name: s for s in range(len(bounds) - 1) for name in units[bounds[s] : bounds[s + 1]]}
    users: dict[str, list[str]] = {}
    for n in nodes:
        for src in n.inputs:
            users.setdefault(src, []).append(n.name)
    edges = []
    for name in units:
        consumers = {stage_of[c] for c in users.get(name, ()) if c in stage_of} - {stage_of[name]}
        if consumers and not cut.by_name[name].rebuilt:
            node = cut.by_name[name]
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
    return tuple(edges)


def _tied(stages: Sequence[Stage]) -> tuple[TiedGroup, ...]:
    """The parameters more than one stage reads, with the stages that read them."""
    owners: dict[str, set[int]] = {}
    for st in stages:
        for fqn in st.parameters:
            owners.setdefault(fqn, set()).add(st.index)
    return tuple(
        TiedGroup(fqn=fqn, stages=tuple(sorted(ss))) for fqn, ss in owners.items() if len(ss) > 1
    )


def stage_costs(
    stages: Sequence[Stage], nodes: Sequence[NodeCost], link: Link, ranks: int = 0,
    placement: Placement = Placement.LOOP,
) -> StageCosts:
    """The costs a plan's schedule is generated from (zero bubble) and simulated on. Given the
    ``ranks`` and their ``placement``, a cut whose two stages share a rank (the turn of a V)
    costs nothing: it is handed over in memory, not sent."""
    by_name = {n.name: n for n in nodes}
    forward, backward = [], []
    for st in stages[:-1]:
        if ranks and rank_of(st.index, ranks, placement) == rank_of(st.index + 1, ranks, placement):
            forward.append(0.0)
            backward.append(0.0)
            continue
        sizes = [value_bytes(by_name[v]) for v in st.outputs]
        counts = [value_messages(by_name[v]) for v in st.outputs]
        forward.append(link.transfer_ms(sum(f for f, _ in sizes), sum(f for f, _ in counts)))
        backward.append(link.transfer_ms(sum(b for _, b in sizes), sum(b for _, b in counts)))
    return StageCosts(
        forward=tuple(s.forward_ms for s in stages),
        backward=tuple(s.backward_ms for s in stages),
        weight=tuple(s.weight_ms for s in stages),
        forward_link=tuple(forward),
        backward_link=tuple(backward),
    )


def plan_costs(plan: Plan) -> StageCosts:
    """:func:`stage_costs` of a plan's stages on its ranks."""
    return stage_costs(plan.stages, plan.nodes, plan.link, plan.num_ranks, plan.schedule.placement)


def plan_schedule(plan: Plan) -> Schedule:
    """The schedule every rank runs for ``plan`` (deterministic: it depends only on the plan)."""
    return build_schedule(plan.schedule, plan.num_ranks, plan.microbatches, plan.stages_per_rank,
                          plan_costs(plan))


def predict(
    stages: Sequence[Stage],
    microbatches: int,
    nodes: Sequence[NodeCost],
    schedule: ScheduleKind,
    link: Link,
    stages_per_rank: int = 1,
    data_parallel: DataParallelOptions | None = None,
) -> Predicted:
    """Step time of the schedule, simulated action by action on the per-stage costs; with
    data parallelism, each rank then runs its stages' collectives over its replicas
    (:func:`replica_sync_ms`: a ring over ``link``, after the rank's last action, as DDP's last
    bucket does)."""
    k = len(stages)
    ranks = k // stages_per_rank
    costs = stage_costs(stages, nodes, link, ranks, schedule.placement)
    sched = build_schedule(schedule, ranks, microbatches, stages_per_rank, costs)
    ends = rank_end_ms(sched, costs.forward, costs.backward, costs.forward_link, costs.backward_link,
                       costs.weight)
    replicas = data_parallel.resolved_replicas if data_parallel is not None else 1
    kind = data_parallel.resolved_kind if data_parallel is not None else DataParallelKind.DDP
    held = [sum(st.param_bytes for st in stages if rank_of(st.index, ranks, schedule.placement) == r)
            for r in range(ranks)]
    step = max((end + replica_sync_ms(b, replicas, link, kind) for end, b in zip(ends, held)), default=0.0)
    busy = microbatches * sum(f + b for f, b in zip(costs.forward, costs.backward))
    stage_ms = tuple(s.time_ms for s in stages)
    return Predicted(
        step_ms=step,
        bubble_fraction=max(0.0, 1.0 - busy / (ranks * step)) if step > 0 else 0.0,
        bottleneck_stage=max(range(k), key=lambda s: stage_ms[s]),
        stage_ms=stage_ms,
        single_device_ms=microbatches * sum(n.forward_ms + n.backward_ms for n in nodes),
    )


def predicted_timeline(plan: Plan) -> list[tuple[Action, float, float]]:
    """The simulator's (action, start ms, end ms) for the plan's schedule and stage costs."""
    costs = plan_costs(plan)
    return timeline(plan_schedule(plan), costs.forward, costs.backward, costs.forward_link,
                    costs.backward_link, costs.weight)


def ring_ms(nbytes: float, members: int, link: Link) -> float:
    """All-gather or reduce-scatter of ``nbytes`` (the whole buffer) over a ring of ``members``."""
    if members <= 1 or nbytes <= 0:
        return 0.0
    return (members - 1) * link.latency_ms + (members - 1) / members * nbytes / link.bandwidth_bytes_per_ms


@overload
def ring_allreduce_ms(nbytes: float, replicas: int, link: Link) -> float: ...
@overload
def ring_allreduce_ms(nbytes: np.ndarray, replicas: int, link: Link) -> np.ndarray: ...
def ring_allreduce_ms(nbytes: float | np.ndarray, replicas: int, link: Link) -> float | np.ndarray:
    """Ring all-reduce: 2·(D−1) steps, each sending 1/D of the buffer to the next replica.

    ``nbytes`` is a byte count or a numpy array of them (the replication DP prices many stages
    at once); nothing to reduce costs nothing.
    """
    steps = 2 * (max(replicas, 1) - 1)
    cost = steps * link.latency_ms + steps / max(replicas, 1) * nbytes / link.bandwidth_bytes_per_ms
    if isinstance(nbytes, np.ndarray):
        return np.where(nbytes > 0, cost, 0.0)
    return float(cost) if nbytes > 0 else 0.0


def _runs(positions: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted unit positions as maximal runs ``[a, e)`` of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs
