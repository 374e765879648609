"""``pipecut.plan``: capture, profile and partition a model into a :class:`~pipecut.plan.Plan`.

Planning runs in one process and needs no torch.distributed. The pure part (cost table in,
plan out) is :func:`pipecut.planning.partition.partition_costs`, so a saved plan's cost table can be
re-partitioned for other devices without profiling again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipecut.capture import as_planned, capture, fingerprint
from pipecut.capture.modes import describe_graph
from pipecut.cluster import Cluster
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.meta import has_meta, input_device
from pipecut.core.program import Captured, Inputs
from pipecut.errors import InputError, PartitionError
from pipecut.parallel import DataParallel, DataParallelKind
from pipecut.passes.costs.microbatching import with_structure
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.ilp import IlpSolver
from pipecut.passes.rewrite.propagate import accepted_shapes
from pipecut.plan import (
    CaptureMethod,
    ChunkedNode,
    CostSource,
    Link,
    NodeCost,
    NodeOp,
    Partitioner,
    Plan,
    Recompute,
    ScheduleKind,
)
from pipecut.planning.autoplan import AUTO, Measurements, choose
from pipecut.planning.heavy import heavy_chunks, merge_costs, new_names
from pipecut.planning.partition import (
    DEFAULT_LINK,
    Devices,
    Split,
    as_devices,
    as_schedule,
    partition_costs,
)
from pipecut.planning.replicas import plan_replicas
from pipecut.profile.calibrate import calibrate as calibrate_costs
from pipecut.profile.calibrate import stage_times
from pipecut.profile.nodes import LossFn, profile
from pipecut.report.text import sequential_note

__all__ = ["default_choices", "plan", "warn_if_sequential"]

log = logging.getLogger(__name__)

def plan(
    model: torch.nn.Module,
    example_inputs: Inputs,
    devices: Devices = 2,
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    microbatches: int | str | None = None,
    schedule: str | ScheduleKind | None = None,
    link: Link = DEFAULT_LINK,
    capture_method: CaptureMethod | None = None,
    leaf_modules: tuple[type, ...] = (),
    repeats: int = 5,
    warmup: int = 2,
    captured: Captured | None = None,
    progress: Callable[[int, int], None] | None = None,
    recompute: bool | None = None,
    partitioner: Partitioner | None = None,
    ilp_time_limit: float = 5.0,
    stages_per_rank: int = 1,
    calibrate: bool = True,
    split: Split | None = None,
    data_parallel: DataParallel | str | None = None,
    solver: IlpSolver | str = IlpSolver.HIGHS,
    device: torch.device | str | None = None,
    chunk_heavy: bool = True,
    cluster: str | Cluster | None = None,
    _profiled: Sequence[NodeCost] | None = None,
) -> Plan:
    """Capture ``model``, profile it on one microbatch of ``example_inputs``, and partition it.

    ``example_inputs`` is one full batch (a tuple of positional tensors or a dict of keyword
    tensors); ``target`` is the matching target for ``loss_fn(output, target)``.
    ``microbatches="auto"`` / ``schedule="auto"``: pick them by predicted step time (see
    :mod:`pipecut.planning.autoplan`); the plan lists every pair considered (``plan.candidates``).
    ``microbatches`` left out (None) is "auto", and so is ``schedule`` then, so a plan
    pipelines by default (``schedule`` left out beside a given microbatch count is GPipe); with
    ``data_parallel="auto"`` both must be given. One microbatch on several stages runs the
    stages one after another: a warning is logged.
    ``recompute``, ``partitioner``, ``ilp_time_limit``, ``stages_per_rank``, ``data_parallel``,
    ``solver`` and ``split`` (a split you choose; the plan reports its cost beside pipecut's optimum) are
    as in :func:`partition_costs`. ``calibrate``: time the first split's
    stages whole, scale the node costs to match (see :mod:`pipecut.profile.calibrate`) and partition
    again.

    ``data_parallel="auto"``: ``devices`` are N equal devices; choose D replicas of a K-stage
    pipeline (N = D × K) by predicted step, gradient all-reduce included (see
    :mod:`pipecut.planning.replicas`), and return the K-stage plan of one replica, planned again at its
    share of the batch (``batch_size`` = B / D), with ``data_parallel`` = D DDP replicas and
    every shape weighed in ``replica_candidates``. ``link`` serves both the pipeline and the
    all-reduce.

    ``chunk_heavy``: with GPipe or (interleaved) 1F1B, a linear-like node costing more than
    total / K (a large-vocabulary LM head) is computed in row pieces that can go to different
    stages, where that lowers the predicted step (see :mod:`pipecut.planning.heavy`); the plan lists such
    nodes in ``chunked`` and the solver detail gives both predictions. The model is unchanged.

    ``cluster="8x8xH100-SXM"`` (or a :class:`~pipecut.cluster.Cluster`): plan a whole training
    run on a cluster that is not here, from estimated costs (the model may be on meta): see
    :func:`pipecut.planning.clusters.plan_cluster`, which this calls with ``data_parallel`` ("auto" or
    None: weigh every D × K of FSDP replicas; a ``DataParallel`` fixes D and the engine), ``microbatches``, ``schedule`` and ``recompute``
    (the run's activation checkpointing; None: selective, True: full, False: none); ``devices``
    and the profiling options are then unused.

    ``device``: where to measure the nodes (None: where ``example_inputs`` are). Give the device
    the stages will run on (``compile`` gives each run's own GPU): a model left on the CPU is
    then timed on that GPU one node at a time, never moved there whole, and not calibrated on
    whole stages here (``compile`` calibrates on the running ranks). The plan records it in
    ``profiled_on``.
    """
    if cluster is not None:
        return _plan_for_cluster(  # left out: plan_cluster's defaults (its run model weighs the bubble)
            cluster, model, example_inputs, loss_fn=loss_fn, target=target,
            microbatches=1 if microbatches is None else microbatches,
            schedule=ScheduleKind.ONE_F_ONE_B if schedule is None else schedule,
            recompute=recompute, data_parallel=data_parallel)
    specs = as_devices(devices)
    here = input_device(example_inputs)
    measure_on = torch.device(device) if device is not None else here
    measured = Measurements(  # used by the "auto" choices: capture and profile per size, once
        lambda first: capture(model, first, method=capture_method, leaf_modules=leaf_modules),
        lambda captured, first, first_target: profile(
            captured, captured.flatten_inputs(first), loss_fn=loss_fn, target=first_target,
            repeats=repeats, warmup=warmup, device=measure_on),
    )
    if data_parallel == AUTO:
        if not isinstance(microbatches, int) or schedule is None or schedule == AUTO or stages_per_rank != 1 or split is not None:
            raise InputError(
                "data_parallel='auto' chooses replicas and stages for a given microbatch count "
                "and schedule: give microbatches and schedule as values (not 'auto'), with "
                "stages_per_rank=1 and no split"
            )
        return plan_replicas(
            example_inputs, target, devices=specs, microbatches=microbatches,
            schedule=as_schedule(schedule), link=link,
            profile_at=measured.costs,
            plan_share=lambda share, share_target, k, replicated: plan(
                model, share, specs[:k], loss_fn=loss_fn, target=share_target,
                microbatches=microbatches, schedule=schedule, link=link,
                capture_method=capture_method, leaf_modules=leaf_modules, repeats=repeats,
                warmup=warmup, progress=progress, recompute=recompute, partitioner=partitioner,
                ilp_time_limit=ilp_time_limit, calibrate=calibrate, solver=solver,
                data_parallel=replicated, device=device, chunk_heavy=chunk_heavy),
        )
    if isinstance(data_parallel, str):
        raise InputError(
            f"plan(data_parallel={data_parallel!r}): give 'auto', a DataParallel(kind=..., "
            f"replicas=...) or None"
        )
    microbatches, schedule = default_choices(microbatches, schedule)  # left out: "auto" pipelines
    if microbatches == AUTO or schedule == AUTO:
        full, _ = first_microbatch(example_inputs, 1)
        tables: dict[int, Sequence[NodeCost]] = {}  # the table each microbatch count was planned on

        def partition_at(costs: Sequence[NodeCost], m: int, k: ScheduleKind) -> Plan:
            tables[m] = costs
            return partition_costs(
                costs, devices=specs, microbatches=m, batch_size=full,
                schedule=k, link=link, recompute=recompute, partitioner=partitioner,
                ilp_time_limit=ilp_time_limit, stages_per_rank=stages_per_rank, split=split,
                data_parallel=data_parallel, solver=solver)

        m, chosen_kind, candidates = choose(
            example_inputs, target, ranks=len(specs), microbatches=microbatches, schedule=schedule,
            stages_per_rank=stages_per_rank, profile_at=measured.costs, partition=partition_at,
        )
        reuse = measured.at(first_microbatch(example_inputs, m)[1])  # captured (and profiled)
        if reuse is not None and reuse[1] is None:  # a size between those profiled, on their graph:
            graph, first_m = reuse[0], first_microbatch(example_inputs, m)[1]  # its interpolated
            described = describe_graph(graph, graph.flatten_inputs(first_m))  # table, calibrated
            reuse = (graph, with_structure(tables[m], described))  # below, on its own values
        chosen = plan(
            model, example_inputs, specs, loss_fn=loss_fn, target=target, microbatches=m,
            schedule=chosen_kind, link=link, capture_method=capture_method,
            leaf_modules=leaf_modules, repeats=repeats, warmup=warmup, progress=progress,
            recompute=recompute, partitioner=partitioner, ilp_time_limit=ilp_time_limit,
            stages_per_rank=stages_per_rank, calibrate=calibrate, split=split,
            data_parallel=data_parallel, solver=solver, device=device, chunk_heavy=chunk_heavy,
            captured=reuse[0] if reuse else None, _profiled=reuse[1] if reuse else None,
        )
        return dataclasses.replace(chosen, candidates=candidates)
    if not isinstance(microbatches, int):
        raise InputError(f"microbatches must be an int or 'auto', got {microbatches!r}")
    kind = as_schedule(schedule)
    # Capture on one microbatch: the stages run microbatches, and torch.export specialises shapes.
    size, first_inputs = first_microbatch(example_inputs, microbatches)
    if captured is None:
        captured = capture(model, first_inputs, method=capture_method, leaf_modules=leaf_modules)
    first = captured.flatten_inputs(first_inputs)
    first_target = split_microbatches(target, microbatches, size, "target")[0] if target is not None else None
    nodes = tuple(_profiled) if _profiled is not None else profile(  # auto: measured while choosing
        captured, first, loss_fn=loss_fn, target=first_target, repeats=repeats, warmup=warmup,
        progress=progress, device=measure_on,
    )
    if not any(is_unit(n) and n.op is not NodeOp.OUTPUT for n in nodes):
        raise PartitionError("the captured graph has no operations to partition")

    original = fingerprint(captured.gm)  # a chunked plan is checked against the captured graph
    method, input_names = captured.method, captured.input_names

    def partition(costs: Sequence[NodeCost], chunked: tuple[ChunkedNode, ...] = ()) -> Plan:
        return dataclasses.replace(partition_costs(
            costs,
            devices=specs,
            microbatches=microbatches,
            batch_size=size,
            schedule=kind,
            link=link,
            fingerprint=original,
            capture=method,
            inputs=input_names,
            recompute=recompute,
            partitioner=partitioner,
            ilp_time_limit=ilp_time_limit,
            stages_per_rank=stages_per_rank,
            split=split,
            data_parallel=data_parallel,
            solver=solver,
        ), chunked=chunked)

    # Which shapes the plan runs without re-planning (shorter sequences, smaller microbatches).
    accepts = accepted_shapes(captured.gm, captured.method, captured.input_names, first)
    first_plan = partition(nodes)
    note = ""
    if has_meta(captured.gm):  # calibration runs whole stages: more than one node's weights
        note = "meta model: nodes measured one at a time on scratch weights, not calibrated"
    elif measure_on != here:  # whole stages would run where the model is, not where it will run
        note = f"nodes measured one at a time on {measure_on}, not calibrated on whole stages"
    elif too_big := [n.name for n in nodes if n.source is CostSource.ESTIMATED]:
        note = (f"{len(too_big)} node(s) too big to run on {measure_on} estimated from their work "
                f"({', '.join(too_big[:3])}), not calibrated on whole stages")
    timed = calibrate and not note

    def calibrated(on: Captured, costs: Sequence[NodeCost], chunked: tuple[ChunkedNode, ...]) -> Plan:
        """The plan of ``costs`` on ``on``'s graph, costs scaled to its stages timed whole."""
        planned = partition(costs, chunked)
        if not timed:
            return planned
        times = stage_times(on, planned, first, loss_fn, first_target, repeats=max(1, repeats // 2))
        return partition(calibrate_costs(costs, planned, times), chunked)

    best = calibrated(captured, nodes, ()) if timed else first_plan
    ordinary = split is None and not kind.splits_backward  # GPipe, 1F1B, interleaved 1F1B
    chunks = heavy_chunks(best.nodes, best.num_stages, captured.gm) if chunk_heavy and ordinary else ()
    notes = [note]
    if chunks:  # a node heavier than a stage's share: try it in row pieces
        chunked = as_planned(captured, chunks)
        estimated = any(n.source is CostSource.ESTIMATED for n in nodes)  # rates need every node
        pieces_table = profile(chunked, first, loss_fn=loss_fn, target=first_target, repeats=repeats,
                               warmup=warmup, device=measure_on, only=None if estimated else new_names(chunks))
        tried = calibrated(chunked, merge_costs(best.nodes, pieces_table, chunks), chunks)
        keep = tried.predicted.step_ms < best.predicted.step_ms
        what = ", ".join(f"{c.node} in {c.pieces} row pieces" for c in chunks)
        notes.append(f"heavy node(s) {what}: predicted step {tried.predicted.step_ms:.3f} ms, "
                     f"{best.predicted.step_ms:.3f} ms whole; {'chunked' if keep else 'kept whole'}")
        best = tried if keep else best
    notes.append("node costs calibrated on whole stages" if timed else "")
    return warn_if_sequential(_noted(dataclasses.replace(best, accepts=accepts, profiled_on=str(measure_on)),
                                     "; ".join(n for n in notes if n)))


def default_choices(microbatches: int | str | None, schedule: Any) -> tuple[int | str, Any]:
    """What ``microbatches`` and ``schedule`` left out (None) mean: the planner chooses
    microbatches ("auto"), and the schedule with them unless one is given; a schedule left out
    beside a given count is GPipe.

    >>> default_choices(None, None), default_choices(None, "1f1b"), default_choices(4, None)
    (('auto', 'auto'), ('auto', '1f1b'), (4, <ScheduleKind.GPIPE: 'gpipe'>))
    """
    if microbatches is None:
        return AUTO, AUTO if schedule is None else schedule
    return microbatches, ScheduleKind.GPIPE if schedule is None else schedule


def warn_if_sequential(p: Plan) -> Plan:
    """Log a warning when ``p`` cannot pipeline: one microbatch on several ranks runs the
    stages one after another, K devices doing the work of one. Returns ``p``."""
    note = sequential_note(p)
    if note:
        log.warning("%s", note)
    return p


def _plan_for_cluster(
    cluster: str | Cluster, model: torch.nn.Module, example_inputs: Inputs, *,
    loss_fn: LossFn | None, target: Any, microbatches: int | str, schedule: str | ScheduleKind,
    recompute: bool | None, data_parallel: DataParallel | str | None,
) -> Plan:
    from pipecut.planning.clusters import plan_cluster

    if not isinstance(microbatches, int) or schedule == AUTO:
        raise InputError("plan(cluster=...) needs microbatches and schedule as values, not 'auto'")
    if isinstance(data_parallel, str) and data_parallel != AUTO:
        raise InputError(f"plan(cluster=...): data_parallel must be 'auto', None or a "
                         f"DataParallel(kind=..., replicas=...), got {data_parallel!r}")
    rec = {None: Recompute.SELECTIVE, True: Recompute.FULL, False: Recompute.NONE}[recompute]
    fixed = data_parallel if isinstance(data_parallel, DataParallel) else None
    return plan_cluster(
        model, example_inputs, cluster, data_parallel=fixed.replicas if fixed else "auto",
        microbatches=microbatches, schedule=as_schedule(schedule), recompute=rec,
        sharding=fixed.kind if fixed else DataParallelKind.FSDP, loss_fn=loss_fn, target=target,
    )


def _noted(p: Plan, note: str) -> Plan:
    """``p`` with ``note`` appended to its solver detail."""
    if not note:
        return p
    detail = f"{p.solver.detail}; {note}" if p.solver.detail else note
    return dataclasses.replace(p, solver=dataclasses.replace(p.solver, detail=detail))
