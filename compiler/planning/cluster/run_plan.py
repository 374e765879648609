"""The per-stage plan of a chosen cluster run: one prediction, shown once.

:func:`pipecut.planning.cluster.plan.plan_cluster` chooses a run (D replicas × K ranks, layout,
schedule, stages per rank) on the training-run model of :mod:`pipecut.planning.cluster.run`,
with the run's recompute and sharding. The plan it returns is one replica's stages of **that**
run: cut where the run is cut, recomputing what the run recomputes, on the run's schedule, and
each stage's times and memory are the run's (:class:`~pipecut.planning.cluster.run.RunStage`),
so the stage table, the memory bars and the Gantt chart show the run the summary's run line
describes, not a second plan priced by other rules.

What comes from the cost table at one replica's share (``nodes``): the stages' nodes, parameters,
inputs and outputs, the cut edges and tied parameters (:func:`pipecut.passes.costs.stages.build_stages`).
What comes from the run: the split, the recompute, the schedule, per stage forward, backward
(recompute included), weight-pass and transfer times, activations and peak memory, and the
predicted step and bubble. The plan's single link is the one the run's cuts cross (the network
where any crosses nodes; a note says so when some cuts stay on NVLink).
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
from collections.abc import Callable, Sequence

import torch

from pipecut.capture import fingerprint
from pipecut.cluster import Cluster, Link
from pipecut.core.kinds import DataParallelKind, Partitioner, Recompute
from pipecut.core.program import Captured
from pipecut.errors import PartitionError
from pipecut.ir import DeviceSpec, NodeCost, Plan, Solver, Stage
from pipecut.options import DataParallelOptions
from pipecut.passes.costs.stages import build_stages
from pipecut.passes.partition.chain import liveness
from pipecut.planning.cluster.run import RunCandidate, RunStage
from pipecut.version import __version__

__all__ = ["mixed_links_note", "plan_of_run"]


def plan_of_run(
    nodes: Sequence[NodeCost], whole: Sequence[NodeCost], run: RunCandidate, *, cluster: Cluster, captured: Captured,
    microbatches: int, batch_size: int, recompute: Recompute, sharding: DataParallelKind,
) -> Plan:
    """One replica's plan of ``run``: ``nodes`` is the cost table at the replica's share (batch
    ``batch_size``), ``whole`` the table ``run`` was priced on (the whole batch), ``captured``
    the graph ``nodes`` were counted on, which the plan names (its fingerprint, capture method
    and inputs), so that ``compile(plan=...)`` replays it on the model."""
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
    for block in difflib.SequenceMatcher(None, whole_ops, ops, autojunk=False).get_matching_blocks():
        for j in range(block.size):
            position[block.a + j] = block.b + j
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
