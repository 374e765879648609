"""Evaluate runs and choose: every D × T × K × layout × schedule of a cost table under each
engine of the replicas, the fastest that fits kept, or the refusal with what would fit; and the
chosen run's step on its table priced at another end of the figures (:func:`step_at`).

The runs are priced by :mod:`pipecut.planning.cluster.run`; the tables at each T's share come from
:mod:`pipecut.planning.cluster.tables`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pipecut.cluster import Cluster, Layout, Link
from pipecut.core.kinds import DataParallelKind, Recompute, ScheduleKind
from pipecut.errors import PartitionError
from pipecut.ir import NodeCost
from pipecut.passes.costs.workload import Workload, workload
from pipecut.passes.parallel.hybrid import ShapeSkipped
from pipecut.passes.parallel.tensor import ShardedTable, shard_table
from pipecut.planning.cluster.run import (
    RunCandidate,
    RunChoice,
    RunShape,
    Splits,
    block_of,
    choose_run,
    evaluate_run,
    merged_choices,
)

__all__ = ["TableSplits", "fastest_engine", "predict_run", "step_at"]

TableSplits = dict[tuple[int, Link], Splits]
"""The min-bottleneck splits of one cost table, by T and the link inside a node (each T's share
is its own workload; a split depends on nothing else the engines or clusters change)."""


def predict_run(
    nodes: Sequence[NodeCost], cluster: Cluster, shape: RunShape, *, replicas: int | None = None,
    schedules: tuple[ScheduleKind, ...] | None = None, tensor_parallel: Sequence[int] = (1,),
    sharded: Mapping[int, ShardedTable] | None = None, search_wider: bool = True,
    splits: TableSplits | None = None,
) -> tuple[RunCandidate, RunChoice, Workload]:
    """The fastest fitting D × T × K × layout (× schedule of ``schedules``, default
    ``shape.schedule``, × stages per rank) for a cost table at microbatch ``B / M``, for each T
    of ``tensor_parallel`` (T > 1 on one GPU's share of the table: ``sharded[T]``, else the
    table's work divided by T, :func:`~pipecut.passes.parallel.tensor.shard_table`); refuses,
    with the memory needed per GPU and the smallest cluster of that device that fits, when none
    fits (``search_wider=False``: no larger cluster is tried, for a caller that only needs the
    refusal). ``splits``: the min-bottleneck splits found so far, by T and the link inside a node,
    shared between calls on the same ``nodes`` (:func:`fastest_engine`'s engines); found ones
    are added."""
    works = {t: _work_of(nodes, t, cluster, shape, sharded) for t in tensor_parallel}
    blocks = block_of(works[tensor_parallel[0]].modules or ("",) * works[tensor_parallel[0]].units)
    found: TableSplits = {} if splits is None else splits
    choice = merged_choices([choose_run(w, blocks, dataclasses.replace(shape, tensor_parallel=t), cluster,
                                        replicas=replicas, schedules=schedules,
                                        splits=found.setdefault((t, cluster.intra), {}))
                             for t, w in works.items()])
    if choice.best is not None:
        return choice.best, choice, works[choice.best.placement.tensor_parallel]
    need = choice.smallest_memory_bytes
    ways = f"pipeline × {shape.sharding.value}" + (f" × tensor parallel (T in {', '.join(map(str, works))})"
                                if max(works) > 1 else "")
    if need is None:
        reasons = "; ".join(f"D={s.replicas} K={s.stages} T={s.tensor_parallel}: {s.reason}" for s in choice.skipped)
        raise PartitionError(f"no D × T × K shape can run on {cluster.spec} ({reasons})")
    bigger = None
    for factor in (2, 4, 8, 16, 32, 64) if search_wider else ():
        wider = dataclasses.replace(cluster, nodes=cluster.nodes * factor)
        if _any_fits(works, blocks, shape, wider, replicas=replicas, schedules=schedules, splits=found):
            bigger = wider.spec
            break
    hint = f"the smallest {cluster.device} cluster that fits is {bigger}" if bigger else (
        f"no cluster up to {cluster.nodes * 64} nodes of {cluster.device} fits" if search_wider else
        "larger clusters not tried")
    raise PartitionError(
        f"the model does not fit on {cluster.spec} with {ways}: it needs at least "
        f"{need / 2**30:.1f} GiB per GPU, a {cluster.device} has {cluster.memory_bytes / 2**30:.1f} "
        f"GiB; {hint} (or use {'' if shape.recompute is Recompute.FULL else 'full activation checkpointing, '}"
        f"a smaller batch or more microbatches"
        + (", or tensor_parallel='auto'" if max(works) == 1 and cluster.gpus_per_node > 1 else "") + ")"
        + ("" if replicas is None else f"; with data_parallel={replicas} fixed")
    )


def _any_fits(works: Mapping[int, Workload], blocks: tuple[int, ...], shape: RunShape, cluster: Cluster, *,
              replicas: int | None, schedules: tuple[ScheduleKind, ...] | None,
              splits: TableSplits) -> bool:
    """Whether any run fits ``cluster`` (one layout: memory does not depend on it), the largest T
    first (the least memory per GPU), stopping at the first that does; ``splits`` as
    :func:`predict_run`'s."""
    return any(choose_run(works[t], blocks, dataclasses.replace(shape, tensor_parallel=t), cluster, replicas=replicas,
                          layouts=(Layout.STAGES_INSIDE_NODES,), schedules=schedules,
                          splits=splits.setdefault((t, cluster.intra), {}), first_fit=True).best is not None
               for t in sorted(works, reverse=True))


def _work_of(nodes: Sequence[NodeCost], t: int, cluster: Cluster, shape: RunShape,
             sharded: Mapping[int, ShardedTable] | None) -> Workload:
    """The workload of one GPU of a ``t``-way tensor group."""
    if t == 1:
        return workload(nodes)
    table = (sharded or {}).get(t) or shard_table(nodes, t, cluster.intra, sequence_parallel=shape.sequence_parallel)
    return workload(table.nodes, table.collectives)


def fastest_engine(nodes: Sequence[NodeCost], cluster: Cluster, shape: RunShape,
                    engines: tuple[DataParallelKind, ...], **kwargs: Any,
                    ) -> tuple[RunCandidate, RunChoice, DataParallelKind]:
    """:func:`predict_run` under each of the replicas' ``engines``: the fastest run that fits
    (the earliest engine on a tie), with its engine; PartitionError naming each engine's
    reason where none fits. The engines share their splits: the time of a split does not depend
    on the engine, and each engine's memory is checked on it after."""
    found: list[tuple[RunCandidate, RunChoice, DataParallelKind]] = []
    errors: list[PartitionError] = []
    splits: TableSplits = {}
    for kind in engines:
        try:
            best, choice, _ = predict_run(nodes, cluster, dataclasses.replace(shape, sharding=kind), splits=splits,
                                          **kwargs)
        except PartitionError as e:
            errors.append(e)
            continue
        found.append((best, choice, kind))
    if found:
        return min(found, key=lambda f: f[0].step_ms)  # min keeps the first of equal steps
    if len(errors) == 1:
        raise errors[0]
    raise PartitionError("under no engine of the replicas: " + "; ".join(
        f"sharding={k.value!r}: {e}" for k, e in zip(engines, errors)))




def step_at(best: RunCandidate, shape: RunShape, nodes: Sequence[NodeCost], sharded: Mapping[int, ShardedTable],
            cluster: Cluster) -> float:
    """The step of ``best`` (its split, layout, schedule, stages per rank and T) on ``nodes`` (and
    their T-way shares ``sharded``) and ``cluster``'s links, all priced at one end of the figures'
    range; ``best``'s own step where that run does not run there."""
    d, k, v, t = best.placement.replicas, best.placement.stages, best.stages_per_rank, best.placement.tensor_parallel
    work = _work_of(nodes, t, cluster, shape, sharded)
    run = dataclasses.replace(shape, schedule=best.schedule, stages_per_rank=v, tensor_parallel=t)
    again = evaluate_run(work, block_of(work.modules or ("",) * work.units), run, cluster,
                         replicas=d, stages=k, layout=best.placement.layout, splits={(d, v * k): best.bounds})
    return best.step_ms if isinstance(again, ShapeSkipped) else again.step_ms
