"""``pipecut.plan``: capture, measure and partition a model into a :class:`~pipecut.ir.Plan`.

Planning runs in one process and needs no torch.distributed. :func:`plan` reads as its steps:
resolve the options into a :class:`~pipecut.planning.request.Request`, then plan for a cluster
(:mod:`~pipecut.planning.cluster.plan`), or (:func:`plan_asked`, where ``compile``'s rank 0 hands
its own request) for replicas (:mod:`~pipecut.planning.replicas`), with the
microbatches and schedule chosen (:mod:`~pipecut.planning.autoplan`), or at fixed ones
(:func:`plan_fixed`: capture → measure → partition → calibrate → heavy nodes in pieces →
finish). The pure part (cost table in, plan out) is
:func:`pipecut.passes.partition.solve.partition_costs`, so a saved plan's cost table can be
re-partitioned for other devices without profiling again.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch

from pipecut.capture import fingerprint
from pipecut.cluster import Cluster
from pipecut.core.kinds import CostSource, DataParallelKind, NodeOp, ScheduleKind
from pipecut.core.meta import has_meta
from pipecut.core.program import Captured, Inputs
from pipecut.errors import InputError, PartitionError
from pipecut.ir import ChunkedNode, NodeCost, Plan
from pipecut.options import (
    AUTO,
    CaptureOptions,
    DataParallelOptions,
    MeasureOptions,
    PartitionOptions,
    RuntimeOptions,
    ScheduleOptions,
    TensorParallelOptions,
    options_of,
    requested,
)
from pipecut.passes.parallel.tensor import rank_share
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.partition.solve import Devices, as_devices, as_schedule, partition_costs
from pipecut.passes.rewrite.propagate import accepted_shapes
from pipecut.planning.asked import Context, resolve
from pipecut.planning.autoplan import plan_auto
from pipecut.planning.heavy import try_pieces
from pipecut.planning.replicas import plan_replicated
from pipecut.planning.request import (
    FirstBatch,
    Request,
    capture_at,
    profile_at,
    warn_if_sequential,
)
from pipecut.profile.calibrate import calibrate as calibrate_costs
from pipecut.profile.calibrate import stage_times
from pipecut.profile.compiled import AMORTIZED_STEPS, CompileChoice, compiled_stage_times
from pipecut.profile.nodes import LossFn

__all__ = ["plan", "plan_asked", "plan_fixed"]


def plan(
    model: torch.nn.Module,
    example_inputs: Inputs,
    devices: Devices = 2,
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    microbatches: int | Literal["auto"] | None = None,
    schedule: ScheduleKind | str | None = None,
    capture: CaptureOptions | None = None,
    measure: MeasureOptions | None = None,
    partition: PartitionOptions | None = None,
    scheduling: ScheduleOptions | None = None,
    data_parallel: DataParallelOptions | DataParallelKind | str | None = None,
    runtime: RuntimeOptions | None = None,
    cluster: str | Cluster | None = None,
    tensor_parallel: TensorParallelOptions | int | str = "auto",
    progress: Callable[[int, int], None] | None = None,
    captured: Captured | None = None,
) -> Plan:
    """Capture ``model``, profile it on one microbatch of ``example_inputs``, and partition it.

    Runs in one process, no torch.distributed needed. Left out, microbatches are "auto", and so
    is the schedule then: the planner picks them by predicted step time and lists every pair in
    ``plan.candidates``. One microbatch on several stages runs the stages one after another: a
    warning is logged. The model is never changed.

    Args:
        model: The model (on the meta device for ``cluster=`` or estimated costs).
        example_inputs: One full batch: a tuple of positional tensors or a dict of keyword
            tensors.
        devices: K, a list of devices, or :class:`~pipecut.ir.DeviceSpec` s with a memory
            capacity and a relative speed.
        loss_fn: ``loss_fn(output, target)``, the loss of one microbatch; None: the output's sum.
        target: The full batch's target for ``loss_fn``.
        microbatches: Microbatches per step, or "auto"; None: "auto".
        schedule: A :class:`~pipecut.core.kinds.ScheduleKind` or its name, or "auto"; None:
            "auto" beside "auto" microbatches, GPipe beside a count.
        capture: How the graph is captured (:class:`~pipecut.options.CaptureOptions`).
        measure: Where and how costs are measured (:class:`~pipecut.options.MeasureOptions`).
        partition: The solver, recompute, a split you choose
            (:class:`~pipecut.options.PartitionOptions`).
        scheduling: Stages per rank (:class:`~pipecut.options.ScheduleOptions`).
        data_parallel: "auto": ``devices`` are N equal devices; choose D replicas of a K-stage
            pipeline (N = D x K) by predicted step, gradient all-reduce included, and return
            one replica's plan at its share of the batch (every shape weighed in
            ``replica_candidates``); ``DataParallelOptions(kind=..., replicas=...)`` plans for
            that many replicas; None: no replicas.
        runtime: How the stages will run; ``RuntimeOptions(compile_stages=True)`` times the
            stages compiled while calibrating, "auto" times both and keeps the cheaper.
        cluster: ``"8x8xH100-SXM"`` or a :class:`~pipecut.cluster.Cluster`: plan a whole run on
            a cluster that is not here from estimated costs (see
            :func:`pipecut.planning.cluster.plan.plan_cluster`).
        tensor_parallel: A :class:`~pipecut.options.TensorParallelOptions`, or its size alone. With
            ``cluster``: "auto" (or no size) weighs every T that divides a node's GPUs and the
            attention heads (each T-way group inside one node, Megatron's column/row split,
            sequence parallel), a size fixes T; 1 plans without it. Without ``cluster`` the plan
            is the pipeline's: ``compile`` splits each stage over its DeviceMesh's "tp"
            dimension, so only "auto" or 1 is taken here.
        progress: Called as ``progress(done, total)`` while nodes are measured.
        captured: The graph to plan, already captured at the first microbatch (``compile``).

    Returns:
        The :class:`~pipecut.ir.Plan`, with what was asked recorded in ``plan.options``.

    Raises:
        InputError: An argument is not valid (an unknown option, "auto" where a value is
            needed, compiled stages with nothing timed, tensor parallelism without a cluster or
            of a size that does not divide the heads or a node's GPUs).
        CaptureError: The model cannot be captured.
        PartitionError: No split fits (memory) or the graph has nothing to partition.
    """
    tp = TensorParallelOptions.of(tensor_parallel)
    if cluster is None and tp.size not in (None, 1):
        raise InputError(f"tensor_parallel={tp.size!r} without a cluster: the plan here is the pipeline's K stages, "
                         f"and compile splits each stage over its DeviceMesh's 'tp' dimension (pass a mesh with "
                         f"dimensions ('pp', 'tp') to compile); or plan a whole run with cluster='8x8xH100-SXM'")
    groups = requested(microbatches=microbatches, schedule=schedule, data_parallel=data_parallel,
                       groups={"capture": capture, "measure": measure, "partition": partition,
                               "scheduling": scheduling, "runtime": runtime, "tensor_parallel": tp})
    request = Request(model=model, example_inputs=example_inputs, target=target, loss_fn=loss_fn,
                      devices=devices, specs=() if cluster is not None else as_devices(devices),
                      options=options_of(groups), progress=progress)
    if cluster is not None:
        return _for_cluster(request, cluster)
    return plan_asked(request, captured)


def plan_asked(request: Request, captured: Captured | None = None) -> Plan:
    """The plan of ``request`` on its resolved devices (``request.specs``), with what was asked
    recorded in ``plan.options``: D replicas x K stages chosen where data parallelism is
    "auto", else the microbatches and schedule left out defaulted (see
    :func:`~pipecut.planning.asked.resolve`) and planned. ``pipecut.plan`` and
    ``compile``'s rank 0 both plan here; ``captured``: the graph, captured already at the first
    microbatch."""
    if request.options.data_parallel.kind == AUTO:
        return _recorded(plan_replicated(request, plan_request), request)
    asked = resolve(request.options, Context.PLAN)
    request = request.with_options(microbatches=asked.microbatches, schedule=asked.schedule)
    return _recorded(plan_request(request, captured), request)


def plan_request(request: Request, captured: Captured | None = None) -> Plan:
    """The plan of a request whose data parallelism is fixed: the auto choices, or one plan."""
    dp = request.options.data_parallel
    if dp.kind is not None and not dp.is_resolved:
        raise InputError(
            f"plan(data_parallel={getattr(dp.kind, 'value', dp.kind)!r}): give 'auto', "
            f"DataParallelOptions(kind=..., replicas=...) or None")
    if AUTO in (request.options.microbatches, request.options.schedule):
        return plan_auto(request, plan_fixed)
    return plan_fixed(request, captured)


def plan_fixed(request: Request, captured: Captured | None = None,
               profiled: Sequence[NodeCost] | None = None) -> Plan:
    """One plan at the request's microbatch count and schedule: capture → measure → partition
    → calibrate → heavy nodes in pieces → finish. ``captured``/``profiled``: a graph and cost
    table measured already (by the auto choices) at this microbatch size."""
    m = request.options.microbatches
    if not isinstance(m, int):
        raise InputError(f"microbatches must be an int or 'auto', got {m!r}")
    batch = FirstBatch.of(request, m)
    captured = captured or capture_at(request, batch.inputs)  # one microbatch: export specialises shapes
    nodes = tuple(profiled) if profiled is not None else _measure(request, captured, batch)
    note = _not_calibrated(request, captured, nodes)
    timed = request.options.measure.calibrate and not note
    _check_compiled_pricing(request, timed, note)

    # Every plan names the graph as captured (a chunked plan is checked against it): hash it once.
    named = functools.partial(_partitioned, request, captured, fingerprint(captured.gm), batch.batch_size)

    def partition(on: Captured, costs: Sequence[NodeCost], chunks: tuple[ChunkedNode, ...]) -> Plan:
        return _plan_and_time_stages(request, on, batch, costs, chunks, named, timed=timed)

    best = partition(captured, nodes, ())
    best, heavy_note = try_pieces(request, captured, batch, best, nodes, partition)
    done = [note, heavy_note, "node costs calibrated on whole stages" if timed else ""]
    return _finished(request, captured, batch, best, "; ".join(n for n in done if n))


def _measure(request: Request, captured: Captured, batch: FirstBatch) -> tuple[NodeCost, ...]:
    """The cost table: every node timed on the first microbatch (see :mod:`pipecut.profile.nodes`)."""
    nodes = profile_at(request, captured, batch.inputs, batch.target, progress=request.progress)
    if not any(is_unit(n) and n.op is not NodeOp.OUTPUT for n in nodes):
        raise PartitionError("the captured graph has no operations to partition")
    return nodes


def _not_calibrated(request: Request, captured: Captured, nodes: Sequence[NodeCost]) -> str:
    """Why whole stages are not timed here (empty: they are)."""
    if request.options.measure.estimate is not None:
        return (f"node costs estimated for {request.options.measure.estimate} from counted FLOPs and "
                f"bytes (MeasureOptions(estimate=...)): nothing timed, not calibrated")
    measure_on = request.measure_on
    if has_meta(captured.gm):  # calibration runs whole stages: more than one node's weights
        return "meta model: nodes measured one at a time on scratch weights, not calibrated"
    if measure_on != request.here:  # whole stages would run where the model is, not where it will run
        return f"nodes measured one at a time on {measure_on}, not calibrated on whole stages"
    if too_big := [n.name for n in nodes if n.source is CostSource.ESTIMATED]:
        return (f"{len(too_big)} node(s) too big to run on {measure_on} estimated from their work "
                f"({', '.join(too_big[:3])}), not calibrated on whole stages")
    return ""


def _check_compiled_pricing(request: Request, timed: bool, why_not: str) -> None:
    """Compiled stages are priced by timing them whole: refuse where this plan times nothing
    whole (rather than price eager kernels as compiled ones)."""
    asked = request.options.runtime.compile_stages
    if asked and not timed:
        raise InputError(
            f"runtime=RuntimeOptions(compile_stages={asked!r}) prices the stages compiled by timing "
            f"them whole here, which this plan does not: "
            f"{why_not or 'calibration is off (MeasureOptions(calibrate=False))'}; plan with "
            f"calibration, or without compile_stages (compile then times the compiled stages on "
            f"the running ranks)")


def _plan_and_time_stages(request: Request, on: Captured, batch: FirstBatch, costs: Sequence[NodeCost],
                           chunked: tuple[ChunkedNode, ...], named: Callable[..., Plan], *, timed: bool) -> Plan:
    """The plan of ``costs`` (``named(costs, chunked)``) on ``on``'s graph (the captured one,
    or it with ``chunked`` nodes in pieces); ``timed``: its stages timed whole (eager,
    compiled, or both as ``RuntimeOptions.compile_stages`` says), the costs scaled to them (see
    :mod:`pipecut.profile.calibrate`) and partitioned again."""
    planned = named(costs, chunked)
    if not timed:
        return planned
    repeats, mode = max(1, request.options.measure.repeats // 2), request.options.runtime.compile_stages
    eager = None
    if mode is not True:
        times = stage_times(on, planned, batch.flat(on), request.loss_fn, batch.target, repeats=repeats)
        eager = named(calibrate_costs(costs, planned, times), chunked)
        if mode is False:
            return eager
    times, seconds = compiled_stage_times(on, planned, batch.flat(on), request.loss_fn, batch.target, repeats)
    compiled = named(calibrate_costs(costs, planned, times), chunked)
    if eager is None:
        return compiled.noted(f"stages priced compiled (compiling took {seconds:.1f} s here)")
    saving_s = (eager.predicted.step_ms - compiled.predicted.step_ms) * AMORTIZED_STEPS / 1e3
    choice = CompileChoice(compiled=saving_s > seconds, eager_step_ms=eager.predicted.step_ms,
                           compiled_step_ms=compiled.predicted.step_ms, compile_s=seconds, source="predicted")
    return (compiled if choice.compiled else eager).noted(choice.note())


def _partitioned(request: Request, captured: Captured, graph_fingerprint: str, batch_size: int,
                 costs: Sequence[NodeCost], chunked: tuple[ChunkedNode, ...]) -> Plan:
    """:func:`partition_costs` for the request; the plan names ``captured``'s graph."""
    options = request.options
    assert isinstance(options.microbatches, int) and options.schedule not in (None, AUTO)
    share = rank_share(costs, options.tensor_parallel.size or 1, request.link,  # one rank's, under TP
                       resolve(options, Context.PLAN).sequence_parallel)
    planned = partition_costs(
        share, devices=request.specs, microbatches=options.microbatches, batch_size=batch_size,
        schedule=as_schedule(options.schedule), link=request.link, partition=request.options.partition,
        stages_per_rank=request.stages_per_rank, data_parallel=request.replication,
        fingerprint=graph_fingerprint, capture=captured.method, inputs=captured.input_names,
    )
    return dataclasses.replace(planned, chunked=chunked)


def _finished(request: Request, captured: Captured, batch: FirstBatch, best: Plan, note: str) -> Plan:
    """The plan with the shapes it runs without re-planning, where it was measured, its notes."""
    accepts = accepted_shapes(captured.gm, captured.method, captured.input_names, batch.flat(captured))
    measured = request.options.measure.estimate is None
    done = dataclasses.replace(best, accepts=accepts, profiled_on=str(request.measure_on) if measured else "")
    return warn_if_sequential(done.noted(note))


def _recorded(p: Plan, request: Request) -> Plan:
    """``p`` with what was asked recorded beside what was chosen."""
    return dataclasses.replace(p, options=request.options)


def _for_cluster(request: Request, cluster: str | Cluster) -> Plan:
    """:func:`~pipecut.planning.cluster.plan.plan_cluster` with the request's options, resolved
    as a cluster plan resolves them (:data:`~pipecut.planning.asked.DEFAULTS`)."""
    from pipecut.planning.cluster.plan import plan_asked_cluster

    if request.options.runtime.compile_stages:
        raise InputError("plan(cluster=...) estimates costs from a device profile: it cannot price "
                         "compiled stages; drop runtime=RuntimeOptions(compile_stages=...)")
    return _recorded(plan_asked_cluster(request.model, request.example_inputs, cluster, request.options,
                                        loss_fn=request.loss_fn, target=request.target), request)
