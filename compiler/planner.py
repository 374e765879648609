"""``pipecut.plan``: capture, profile and partition a model into a :class:`~pipecut.plan.Plan`.

Planning runs in one process and needs no torch.distributed. :func:`partition_costs` is the
pure part (cost table in, plan out), so a saved plan's cost table can be re-partitioned for
other devices without profiling again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import pipecut
from pipecut.autoplan import AUTO, Measurements, choose
from pipecut.capture import capture, fingerprint
from pipecut.core.batching import first_microbatch, split_microbatches
from pipecut.core.choices import enum_choice
from pipecut.core.meta import has_meta, input_device
from pipecut.core.program import Captured, Inputs
from pipecut.errors import InputError, PartitionError
from pipecut.parallel import DataParallel
from pipecut.passes.chain import boundary_bytes, can_cross, is_unit, liveness
from pipecut.passes.coarsen import candidate_cuts
from pipecut.passes.holders import stage_count_error
from pipecut.passes.ilp import IlpSolver
from pipecut.passes.memory_dp import partition_bounded
from pipecut.passes.memory_floor import infeasible_error
from pipecut.passes.memory_partition import partition_ilp
from pipecut.passes.pinned import bounds_from_modules, bounds_from_split_points, is_split_points
from pipecut.passes.problem import formulate
from pipecut.passes.propagate import accepted_shapes
from pipecut.passes.stages import build_stages, inflight_microbatches
from pipecut.plan import (
    CaptureMethod,
    CostSource,
    DeviceSpec,
    Link,
    NodeCost,
    NodeOp,
    Partitioner,
    Plan,
    Recompute,
    ScheduleKind,
    Solver,
)
from pipecut.profile.calibrate import calibrate as calibrate_costs
from pipecut.profile.calibrate import stage_times
from pipecut.profile.nodes import LossFn, profile
from pipecut.replicas import plan_replicas

__all__ = [
    "DEFAULT_LINK",
    "LARGE_GRAPH_UNITS",
    "Devices",
    "as_devices",
    "as_ilp_solver",
    "as_schedule",
    "partition_costs",
    "plan",
]

LARGE_GRAPH_UNITS = 2000
"""Above this many units the DP prunes its search with a bound (same optimum, far faster)."""

DEFAULT_LINK = Link(bandwidth_bytes_per_ms=2e6, latency_ms=0.05, measured=False)
"""2 GB/s and 50 µs per message: the order of gloo over loopback on a small CPU machine."""

Devices = int | Sequence[str | DeviceSpec]
Split = Sequence[str] | Sequence[Sequence[str]]
"""Module names where stages 1.. begin, or module names per stage."""


def as_schedule(schedule: str | ScheduleKind) -> ScheduleKind:
    return enum_choice(ScheduleKind, schedule, "schedule")


def as_devices(devices: Devices) -> tuple[DeviceSpec, ...]:
    """Normalise an int K, device names or :class:`DeviceSpec` objects."""
    if isinstance(devices, bool) or not isinstance(devices, (int, Sequence)) or isinstance(devices, str):
        raise InputError(
            f"devices must be an int, a list of device names or DeviceSpec, got {devices!r}"
        )
    if isinstance(devices, int):
        if devices < 1:
            raise PartitionError(f"the number of stages (devices) must be at least 1, got {devices}")
        kind = "cuda" if torch.cuda.is_available() else "cpu"
        return tuple(DeviceSpec(name=kind) for _ in range(devices))
    specs = tuple(d if isinstance(d, DeviceSpec) else DeviceSpec(name=str(d)) for d in devices)
    if not specs:
        raise PartitionError("the number of stages (devices) must be at least 1, got 0")
    return specs


def as_ilp_solver(solver: IlpSolver | str) -> IlpSolver:
    """``"highs"``/``"cbc"`` (or the enum) → :class:`IlpSolver`; InputError lists the choices."""
    return enum_choice(IlpSolver, solver, "ILP solver")


def _use_ilp(specs: Sequence[DeviceSpec], recompute: bool) -> bool:
    """The DP is exact and fast for equal devices without memory limits or recompute."""
    return (
        recompute
        or any(d.memory_bytes is not None for d in specs)
        or len({d.speed for d in specs}) > 1
    )


def partition_costs(
    nodes: Sequence[NodeCost],
    *,
    devices: Devices,
    microbatches: int,
    batch_size: int,
    schedule: str | ScheduleKind = ScheduleKind.GPIPE,
    link: Link = DEFAULT_LINK,
    fingerprint: str = "",
    capture: CaptureMethod = CaptureMethod.SYMBOLIC_TRACE,
    inputs: Sequence[str] = (),
    recompute: bool | None = None,
    partitioner: Partitioner | None = None,
    ilp_time_limit: float = 5.0,
    stages_per_rank: int = 1,
    split: Split | None = None,
    data_parallel: DataParallel | None = None,
    solver: IlpSolver | str = IlpSolver.HIGHS,
) -> Plan:
    """Partition a cost table (pure data) into a plan.

    ``devices`` are the ranks; with ``stages_per_rank`` V > 1 (interleaved schedules) the graph
    is cut into K * V stages and stage s runs on device s mod K.

    ``recompute``: may a stage recompute its forward in backward to fit in memory? None (the
    default) allows it when some device has a memory capacity. ``partitioner``: None picks the
    exact DP for equal devices without memory limits or recompute and the ILP otherwise; DP or
    ILP forces one. ``ilp_time_limit``: seconds the ILP solver may spend in total; the plan's
    solver record says whether the ILP proved its answer optimal. ``solver``: the ILP's solver,
    ``"highs"`` (default) or ``"cbc"`` (:class:`~pipecut.passes.ilp.IlpSolver`).

    ``split`` pins the split instead: module FQNs per stage (``[["emb", "blocks.0"],
    ["blocks.1", "head"]]``) or the modules where stages 1.. begin (``["blocks.1"]``). The plan
    then reports pipecut's own optimum beside it (``predicted.optimum_step_ms``).
    ``data_parallel``: the replicas each
    stage will have and their engine; FSDP shrinks the memory a stage needs (see
    :func:`pipecut.passes.stages.state_bytes`).
    """
    kind = as_schedule(schedule)
    ilp_solver = as_ilp_solver(solver)  # checked even when the DP runs: a typo is refused
    if stages_per_rank < 1 or (stages_per_rank > 1 and kind is not ScheduleKind.INTERLEAVED_1F1B):
        raise InputError(
            f"stages_per_rank={stages_per_rank}: several stages per rank need "
            f"schedule='interleaved-1f1b'; use 1 otherwise"
        )
    ranks = as_devices(devices)
    specs = tuple(ranks[s % len(ranks)] for s in range(len(ranks) * stages_per_rank))
    k = len(specs)
    allow = any(d.memory_bytes is not None for d in specs) if recompute is None else recompute
    method = partitioner or (Partitioner.ILP if _use_ilp(specs, allow) else Partitioner.DP)
    if method is Partitioner.GIVEN:
        raise InputError("partitioner must be Partitioner.DP, Partitioner.ILP or None")
    start = time.perf_counter()
    units = sum(1 for n in nodes if is_unit(n))
    optimum_ms = 0.0
    if split is not None:
        live = liveness(nodes)
        bounds, recomputes = _given_bounds(nodes, live, split, k, link), [Recompute.NONE] * k
        optimum = partition_costs(
            nodes, devices=ranks, microbatches=microbatches, batch_size=batch_size,
            schedule=kind, link=link, recompute=recompute, partitioner=partitioner,
            ilp_time_limit=ilp_time_limit, stages_per_rank=stages_per_rank,
            data_parallel=data_parallel, solver=solver,
        )
        optimum_ms = optimum.predicted.step_ms
        record = Solver(
            method=Partitioner.GIVEN, solve_ms=(time.perf_counter() - start) * 1e3,
            optimal=False, detail=f"split given: {_describe_split(split)}",
        )
    elif method is Partitioner.DP:
        # The exact DP over the whole cost model, pruned by a bound (10,000 units in 0.1 s);
        # on large graphs a split over module boundaries first tightens the bound.
        form = formulate(
            nodes, devices=specs, link=link, schedule=kind, microbatches=microbatches,
            recompute=False, data_parallel=data_parallel,
        )
        live = form.live
        cuts = form.problem.allowed_cuts()
        if k - 1 > len(cuts):
            raise PartitionError(
                f"cannot cut this graph into {k} stages: it has {form.problem.units} partitionable "
                f"nodes and only {len(cuts)} places where every live value can cross a cut; "
                f"use at most {len(cuts) + 1} devices"
            )
        too_many = stage_count_error(k, form.problem.holds_params, cuts)
        if too_many is not None:
            raise too_many
        coarse = (candidate_cuts(form.modules, form.problem.compute_ms, form.problem.boundary_ms)
                  if units > LARGE_GRAPH_UNITS else ())
        best = partition_bounded(form.problem, coarse=coarse)
        if best is None:
            raise infeasible_error(
                form.problem, inflight_for=lambda m: inflight_microbatches(kind, m, microbatches),
                positions=coarse or None,
            )
        bounds, recomputes = best.bounds, [Recompute.NONE] * k
        record = Solver(
            method=Partitioner.DP, solve_ms=(time.perf_counter() - start) * 1e3, optimal=True,
            detail=f"exact DP over {units} units",
        )
    else:
        form = formulate(
            nodes, devices=specs, link=link, schedule=kind, microbatches=microbatches,
            recompute=allow, data_parallel=data_parallel,
        )
        live = form.live
        result = partition_ilp(
            form.problem,
            modules=form.modules,
            inflight_for=lambda n: inflight_microbatches(kind, n, microbatches),
            time_limit_s=ilp_time_limit,
            solver=ilp_solver,
        )
        bounds, recomputes = result.evaluation.bounds, list(result.evaluation.recompute)
        record = Solver(
            method=Partitioner.ILP, solve_ms=result.solve_ms, optimal=result.optimal,
            detail=result.detail,
        )
    facts = build_stages(
        nodes, live, bounds, devices=specs, link=link, schedule=kind, microbatches=microbatches,
        recompute=recomputes, stages_per_rank=stages_per_rank, data_parallel=data_parallel,
    )
    predicted = dataclasses.replace(facts.predicted, optimum_step_ms=optimum_ms or facts.predicted.step_ms)
    return Plan(
        fingerprint=fingerprint,
        capture=capture,
        schedule=kind,
        microbatches=microbatches,
        batch_size=batch_size,
        inputs=tuple(inputs),
        nodes=tuple(nodes),
        stages=facts.stages,
        edges=facts.edges,
        devices=specs,
        link=link,
        predicted=predicted,
        solver=record,
        tied=facts.tied,
        stages_per_rank=stages_per_rank,
        data_parallel=data_parallel,
        pipecut_version=pipecut.__version__,
        torch_version=torch.__version__,
    )


def _given_bounds(
    nodes: Sequence[NodeCost], live: Any, split: Split, stages: int, link: Link
) -> tuple[int, ...]:
    units = [n for n in nodes if is_unit(n)]
    if is_split_points(split):
        bounds = bounds_from_split_points(units, split)  # type: ignore[arg-type]
    else:
        bounds = bounds_from_modules(units, split)  # type: ignore[arg-type]
    if len(bounds) - 1 != stages:
        raise PartitionError(
            f"the given split has {len(bounds) - 1} stages but {stages} are planned "
            f"(devices x stages_per_rank); give {stages} module lists or {stages - 1} split points"
        )
    _, _, allowed = boundary_bytes(nodes, live)
    for b in bounds[1:-1]:
        if not allowed[b]:
            blocked = [v for v in live.crossing(b) if not can_cross(next(n for n in nodes if n.name == v))]
            raise PartitionError(
                f"the given split cuts before node {units[b].name}, where value(s) {blocked[:3]} "
                f"cannot cross a cut (not serializable); move that split point"
            )
    return bounds


def _describe_split(split: Split) -> str:
    if is_split_points(split):
        return "stages begin at " + ", ".join(split)  # type: ignore[arg-type]
    return " | ".join(",".join(stage) for stage in split)


def plan(
    model: torch.nn.Module,
    example_inputs: Inputs,
    devices: Devices = 2,
    *,
    loss_fn: LossFn | None = None,
    target: Any = None,
    microbatches: int | str = 1,
    schedule: str | ScheduleKind = ScheduleKind.GPIPE,
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
    _profiled: Sequence[NodeCost] | None = None,
) -> Plan:
    """Capture ``model``, profile it on one microbatch of ``example_inputs``, and partition it.

    ``example_inputs`` is one full batch (a tuple of positional tensors or a dict of keyword
    tensors); ``target`` is the matching target for ``loss_fn(output, target)``.
    ``microbatches="auto"`` / ``schedule="auto"``: pick them by predicted step time (see
    :mod:`pipecut.autoplan`); the plan lists every pair considered (``plan.candidates``).
    ``recompute``, ``partitioner``, ``ilp_time_limit``, ``stages_per_rank``, ``data_parallel``,
    ``solver`` and ``split`` (a split you choose; the plan reports its cost beside pipecut's optimum) are
    as in :func:`partition_costs`. ``calibrate``: time the first split's
    stages whole, scale the node costs to match (see :mod:`pipecut.profile.calibrate`) and partition
    again.

    ``data_parallel="auto"``: ``devices`` are N equal devices; choose D replicas of a K-stage
    pipeline (N = D × K) by predicted step, gradient all-reduce included (see
    :mod:`pipecut.replicas`), and return the K-stage plan of one replica, planned again at its
    share of the batch (``batch_size`` = B / D), with ``data_parallel`` = D DDP replicas and
    every shape weighed in ``replica_candidates``. ``link`` serves both the pipeline and the
    all-reduce.

    ``device``: where to measure the nodes (None: where ``example_inputs`` are). Give the device
    the stages will run on (``compile`` gives each run's own GPU): a model left on the CPU is
    then timed on that GPU one node at a time, never moved there whole, and not calibrated on
    whole stages here (``compile`` calibrates on the running ranks). The plan records it in
    ``profiled_on``.
    """
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
        if not isinstance(microbatches, int) or schedule == AUTO or stages_per_rank != 1 or split is not None:
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
                data_parallel=replicated, device=device),
        )
    if isinstance(data_parallel, str):
        raise InputError(
            f"plan(data_parallel={data_parallel!r}): give 'auto', a DataParallel(kind=..., "
            f"replicas=...) or None"
        )
    if microbatches == AUTO or schedule == AUTO:
        full, _ = first_microbatch(example_inputs, 1)
        m, chosen_kind, candidates = choose(
            example_inputs, target, ranks=len(specs), microbatches=microbatches, schedule=schedule,
            stages_per_rank=stages_per_rank,
            profile_at=measured.costs,
            partition=lambda costs, m, k: partition_costs(
                costs, devices=specs, microbatches=m, batch_size=full,
                schedule=k, link=link, recompute=recompute, partitioner=partitioner,
                ilp_time_limit=ilp_time_limit, stages_per_rank=stages_per_rank, split=split,
                data_parallel=data_parallel, solver=solver),
        )
        reuse = measured.at(first_microbatch(example_inputs, m)[1])  # captured (and profiled)
        chosen = plan(
            model, example_inputs, specs, loss_fn=loss_fn, target=target, microbatches=m,
            schedule=chosen_kind, link=link, capture_method=capture_method,
            leaf_modules=leaf_modules, repeats=repeats, warmup=warmup, progress=progress,
            recompute=recompute, partitioner=partitioner, ilp_time_limit=ilp_time_limit,
            stages_per_rank=stages_per_rank, calibrate=calibrate, split=split,
            data_parallel=data_parallel, solver=solver, device=device,
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

    def partition(costs: Sequence[NodeCost]) -> Plan:
        return partition_costs(
            costs,
            devices=specs,
            microbatches=microbatches,
            batch_size=size,
            schedule=kind,
            link=link,
            fingerprint=fingerprint(captured.gm),
            capture=captured.method,
            inputs=captured.input_names,
            recompute=recompute,
            partitioner=partitioner,
            ilp_time_limit=ilp_time_limit,
            stages_per_rank=stages_per_rank,
            split=split,
            data_parallel=data_parallel,
            solver=solver,
        )

    # Which shapes the plan runs without re-planning (shorter sequences, smaller microbatches).
    accepts = accepted_shapes(captured.gm, captured.method, captured.input_names, first)
    first_plan = dataclasses.replace(partition(nodes), accepts=accepts, profiled_on=str(measure_on))
    note = ""
    if has_meta(captured.gm):  # calibration runs whole stages: more than one node's weights
        note = "meta model: nodes measured one at a time on scratch weights, not calibrated"
    elif measure_on != here:  # whole stages would run where the model is, not where it will run
        note = f"nodes measured one at a time on {measure_on}, not calibrated on whole stages"
    elif too_big := [n.name for n in nodes if n.source is CostSource.ESTIMATED]:
        note = (f"{len(too_big)} node(s) too big to run on {measure_on} estimated from their work "
                f"({', '.join(too_big[:3])}), not calibrated on whole stages")
    if note:
        detail = f"{first_plan.solver.detail}; {note}" if first_plan.solver.detail else note
        return dataclasses.replace(first_plan, solver=dataclasses.replace(first_plan.solver, detail=detail))
    if not calibrate:
        return first_plan
    times = stage_times(captured, first_plan, first, loss_fn, first_target, repeats=max(1, repeats // 2))
    calibrated = partition(calibrate_costs(nodes, first_plan, times))
    note = "node costs calibrated on whole stages"
    detail = f"{calibrated.solver.detail}; {note}" if calibrated.solver.detail else note
    return dataclasses.replace(
        calibrated, solver=dataclasses.replace(calibrated.solver, detail=detail), accepts=accepts,
        profiled_on=str(measure_on),
    )

