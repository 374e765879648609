"""The per-stage plan of a chosen cluster run: one prediction, shown once.

:func:`pipecut.planning.cluster.plan.plan_cluster` chooses a run (D replicas × K ranks, layout,
schedule, stages per rank) on the training-run model of :mod:`pipecut.planning.cluster.run`,
with the run's recompute and sharding. The plan it returns is one replica's stages of **that**
run: cut where the run is cut, recomputing what the run recomputes, on the run's schedule, and
each stage's times and memory are the run's (:class:`~pipecut.planning.cluster.run.RunStage`),
so the stage table, the memory bars and the Gantt chart show the run the summary's run line
describes, not a second plan priced by other rules.

What comes from the replica's graph, captured and counted at its share of the batch (the graph
``compile`` replays): the nodes' names, shapes, inputs and parameters, so the stages' nodes,
inputs and outputs, the cut edges and tied parameters (:func:`pipecut.passes.costs.stages.build_stages`).
What comes from the run: each node's times and bytes, those of its twin in the table the run was
priced on over the D replicas, as the run prices a replica's share (:func:`replica_rows`; the
share is not priced again); the split, the recompute, the schedule, per stage forward, backward
(recompute included), weight-pass and transfer times, activations and peak memory, and the
predicted step and bubble. The plan's single link is the one the run's cuts cross (the network
where any crosses nodes; a note says so when some cuts stay on NVLink).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import math
from collections.abc import Callable, Sequence

import torch

from pipecut.capture import fingerprint
from pipecut.cluster import Cluster, Link
from pipecut.core.kinds import DataParallelKind, Partitioner, Recompute
from pipecut.core.program import Captured
from pipecut.errors import PartitionError
from pipecut.ir import CostSource, DeviceSpec, NodeCost, Plan, Solver, Stage
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import build_stages
from pipecut.passes.partition.chain import liveness
from pipecut.planning.cluster.run import RunCandidate, RunStage
from pipecut.version import __version__

__all__ = ["mixed_links_note", "plan_of_run", "replica_rows"]


def plan_of_run(
    counted: Sequence[NodeCost], whole: Sequence[NodeCost], run: RunCandidate, *, cluster: Cluster, captured: Captured,
    microbatches: int, batch_size: int, recompute: Recompute, sharding: DataParallelKind,
) -> Plan:
    """One replica's plan of ``run``: ``counted`` is the replica's graph counted at its share
    (batch ``batch_size``; no times), ``whole`` the table ``run`` was priced on (the whole batch,
    at one GPU's share of a tensor group), ``captured`` the graph ``counted`` came from, which the
    plan names (its fingerprint, capture method and inputs), so that ``compile(plan=...)``
    replays it on the model."""
    nodes = replica_rows(counted, whole, run.placement.replicas)
    live = liveness(nodes)
    at = _aligned(nodes, live.units, whole)
    bounds = [*(at(b) for b in run.bounds[:-1]), len(live.units)]
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        raise PartitionError(
            f"the run's cuts (before units {list(run.bounds[1:-1])} of the whole batch's table) do "
            f"not map onto the table at one replica's share (units {bounds[1:-1]}): the model "
            f"captures differently at the two batch sizes; fix data_parallel to 1"
        )
    devices = tuple(DeviceSpec(name=cluster.device, memory_bytes=cluster.memory_bytes) for _ in run.stages)
    recomputed = [tuple(live.units[at(u)] for u in st.recomputed if bounds[s] <= at(u) < bounds[s + 1])
                  for s, st in enumerate(run.stages)]
    kinds = [recompute if names else Recompute.NONE for names in recomputed]
    d = run.placement.replicas
    dp = DataParallelOptions.resolved(sharding, d) if d > 1 else None
    link = _link_of(cluster, run)
    facts = build_stages(
        nodes, live, bounds, devices=devices, link=link, schedule=run.schedule, microbatches=microbatches,
        recompute=kinds, recomputed=[names if kind is Recompute.SELECTIVE else () for names, kind in zip(recomputed, kinds)],
        stages_per_rank=run.stages_per_rank, data_parallel=dp,
    )
    stages = tuple(_as_run(st, r) for st, r in zip(facts.stages, run.stages))
    stage_ms = tuple(s.time_ms for s in stages)
    predicted = dataclasses.replace(
        facts.predicted, step_ms=run.step_ms, bubble_fraction=run.bubble_fraction,
        bottleneck_stage=max(range(len(stages)), key=lambda s: stage_ms[s]), stage_ms=stage_ms,
        optimum_step_ms=run.step_ms,
    )
    solver = Solver(method=Partitioner.DP, optimal=False, detail=(
        f"the cluster run's split: min-bottleneck over module boundaries at one of {d} replicas' share "
        f"(pipecut.planning.cluster.run), {run.schedule.value} on {run.stages_per_rank} stage(s) per rank"))
    return Plan(
        fingerprint=fingerprint(captured.gm), capture=captured.method, schedule=run.schedule,
        microbatches=microbatches, batch_size=batch_size, inputs=captured.input_names, nodes=tuple(nodes), stages=stages,
        edges=facts.edges, devices=devices, link=link, predicted=predicted, solver=solver, tied=facts.tied,
        stages_per_rank=run.stages_per_rank, data_parallel=dp, pipecut_version=__version__,
        torch_version=torch.__version__,
    )


def replica_rows(counted: Sequence[NodeCost], priced: Sequence[NodeCost], replicas: int) -> tuple[NodeCost, ...]:
    """The plan's rows: each row of ``counted`` (the replica's graph: its names, inputs, shapes,
    parameters) with the times, bytes and marks of its twin in ``priced`` (the table the run was
    priced on), the times and activation bytes over ``replicas``, as the run model prices one
    replica's share (:mod:`~pipecut.planning.cluster.run`: ``B / (M·D)`` samples a microbatch),
    and the parameter bytes as they are (one GPU's share of a tensor group where ``priced`` is
    sharded). Twins are found as in :func:`_aligned`, as sequences of ops of modules; a row the
    priced graph has none for (a shape node that a capture at another batch size adds) costs
    nothing."""
    twin = _twins(priced, counted)
    rows = []
    for row, i in zip(counted, twin):
        if i is None:
            rows.append(dataclasses.replace(row, forward_ms=0.0, backward_ms=0.0, source=CostSource.ESTIMATED))
            continue
        p = priced[i]
        rows.append(dataclasses.replace(
            row, forward_ms=p.forward_ms / replicas, backward_ms=p.backward_ms / replicas,
            output_bytes=math.ceil(p.output_bytes / replicas),
            saved_bytes=None if p.saved_bytes is None else math.ceil(p.saved_bytes / replicas),
            param_bytes=p.param_bytes, source=p.source, rebuilt=p.rebuilt))
    return tuple(rows)


def _twins(a: Sequence[NodeCost], b: Sequence[NodeCost]) -> list[int | None]:
    """For each row of ``b``, the index of the row of ``a`` it matches as a sequence of (op,
    target, module), or None."""
    twin: list[int | None] = [None] * len(b)
    for i, j in _pairs([(n.op, n.target, n.module) for n in a], [(n.op, n.target, n.module) for n in b]):
        twin[j] = i
    return twin


def _pairs(a: Sequence[object], b: Sequence[object]) -> list[tuple[int, int]]:
    """The positions (i in ``a``, j in ``b``) where the two sequences match (``difflib``'s
    matching blocks, junk not guessed), in order."""
    if a == b:
        return [(i, i) for i in range(len(a))]
    return [(block.a + k, block.b + k)
            for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
            for k in range(block.size)]


def mixed_links_note(cluster: Cluster, run: RunCandidate) -> str:
    """A note when the run's cuts cross both links (the plan can name only one), else ""."""
    crossed = set(run.cut_links) - {"same GPU"}
    if len(crossed) < 2:
        return ""
    across = sum(1 for c in run.cut_links if c == cluster.inter.name)
    return (f"{across} of the {len(run.cut_links)} cuts cross nodes, the others stay on "
            f"{cluster.intra.name}: the run prices each on its own link, the plan's one link "
            f"(and its Gantt chart) is the slower, {cluster.inter.name}")


def _aligned(nodes: Sequence[NodeCost], units: Sequence[str], whole: Sequence[NodeCost]) -> Callable[[int], int]:
    """Unit i of the whole batch's table as a position in the share's (``units``): the two unit
    chains matched as sequences of ops of modules (``difflib``), unit i going to the share's unit
    it matches, or, where the share's capture has no such unit, to the next one that matches. A
    capture at another batch size adds or drops shape nodes (``sym_size``, a batch-1 capture's
    ``slice`` and ``expand`` folded away), which cost nothing, and numbers the rest anew, so the
    names of the two tables do not say which nodes are the same. Never decreasing in i."""
    names = liveness(whole).units
    share, full = {n.name: n for n in nodes}, {n.name: n for n in whole}
    ops = [(share[u].target, share[u].module) for u in units]
    whole_ops = [(full[u].target, full[u].module) for u in names]
    if ops == whole_ops:
        return lambda i: i
    position = [len(units)] * (len(names) + 1)
    for i, j in _pairs(whole_ops, ops):
        position[i] = j
    for i in range(len(names) - 1, -1, -1):  # an unmatched unit: the next matched one's place
        position[i] = min(position[i], position[i + 1])
    return lambda i: position[min(i, len(names))]


def _link_of(cluster: Cluster, run: RunCandidate) -> Link:
    """The link the run's cuts cross: the network if any crosses nodes, else NVLink."""
    chosen: Link = cluster.inter if cluster.inter.name in run.cut_links else cluster.intra
    return Link(bandwidth_bytes_per_ms=chosen.bandwidth_bytes_per_ms, latency_ms=chosen.latency_ms)


def _as_run(stage: Stage, run: RunStage) -> Stage:
    """``stage`` with the run's times, activations and memory."""
    return dataclasses.replace(
        stage, forward_ms=run.forward_ms, backward_ms=run.backward_ms, weight_ms=run.weight_ms,
        comm_ms=run.comm_ms, activation_bytes=run.activation_bytes, peak_memory_bytes=run.memory_bytes,
    )
