"""Partition a cost table into stages: the pure part of planning (cost table in, plan out).

:func:`partition_costs` picks the exact bounded DP for equal devices without memory limits or
recompute and the ILP otherwise, or scores a split the user gives beside pipecut's optimum. A
saved plan's cost table can be re-partitioned here for other devices without profiling again.
Also here: the options every planning entry point reads (devices, schedule, ILP solver, link).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

import pipecut
from pipecut.core.choices import enum_choice
from pipecut.core.schedule import rank_of, stages_on
from pipecut.errors import InputError, PartitionError
from pipecut.parallel import DataParallel
from pipecut.passes.costs.stages import build_stages, inflight_microbatches
from pipecut.passes.partition.chain import boundary_bytes, can_cross, is_unit, liveness
from pipecut.passes.partition.coarsen import block_cuts, candidate_cuts
from pipecut.passes.partition.holders import stage_count_error
from pipecut.passes.partition.ilp import IlpSolver
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_floor import infeasible_error
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.pinned import (
    bounds_from_modules,
    bounds_from_split_points,
    is_split_points,
)
from pipecut.passes.partition.problem import Formulation, formulate
from pipecut.passes.partition.refine import refine_cuts
from pipecut.plan import (
    CaptureMethod,
    DeviceSpec,
    Link,
    NodeCost,
    Partitioner,
    Plan,
    Recompute,
    ScheduleKind,
    Solver,
    Stage,
)

__all__ = [
    "DEFAULT_LINK",
    "LARGE_GRAPH_UNITS",
    "Devices",
    "Split",
    "as_devices",
    "as_ilp_solver",
    "as_schedule",
    "partition_costs",
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
    is cut into K * V stages and stage s runs on device s mod K. ZBV always cuts 2K stages
    (``stages_per_rank`` 1, the default, or 2), rank r running stages r and 2K - 1 - r.

    ``recompute``: may a stage recompute its forward in backward to fit in memory? None (the
    default) allows it when some device has a memory capacity. ``partitioner``: None picks the
    exact DP for equal devices without memory limits or recompute and the ILP otherwise; DP or
    ILP forces one. ``ilp_time_limit``: seconds the ILP solver may spend in total; the plan's
    solver record says whether the ILP proved its answer optimal. ``solver``: the ILP's solver,
    ``"highs"`` (default) or ``"cbc"`` (:class:`~pipecut.passes.partition.ilp.IlpSolver`).

    ``split`` pins the split instead: module FQNs per stage (``[["emb", "blocks.0"],
    ["blocks.1", "head"]]``) or the modules where stages 1.. begin (``["blocks.1"]``). The plan
    then reports pipecut's own optimum beside it (``predicted.optimum_step_ms``).
    ``data_parallel``: the replicas each
    stage will have and their engine; FSDP shrinks the memory a stage needs (see
    :func:`pipecut.passes.costs.stages.state_bytes`).
    """
    kind = as_schedule(schedule)
    ilp_solver = as_ilp_solver(solver)  # checked even when the DP runs: a typo is refused
    stages_per_rank = _stages_per_rank(kind, stages_per_rank)
    ranks = as_devices(devices)
    specs = tuple(ranks[rank_of(s, len(ranks), kind.placement)] for s in range(len(ranks) * stages_per_rank))
    k = len(specs)
    allow = any(d.memory_bytes is not None for d in specs) if recompute is None else recompute
    method = partitioner or (Partitioner.ILP if _use_ilp(specs, allow) else Partitioner.DP)
    if method is Partitioner.GIVEN:
        raise InputError("partitioner must be Partitioner.DP, Partitioner.ILP or None")
    start = time.perf_counter()
    units = sum(1 for n in nodes if is_unit(n))
    optimum_ms = 0.0
    recomputed: list[tuple[str, ...]] = [()] * k  # per stage, under Recompute.SELECTIVE
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
        bounds, moved = _refined(bounds, form, nodes, specs, ranks, link, kind, microbatches,
                                 stages_per_rank, data_parallel)
        record = Solver(
            method=Partitioner.DP, solve_ms=(time.perf_counter() - start) * 1e3, optimal=True,
            detail=f"exact DP over {units} units{moved}",
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
        recomputed = [tuple(u for a, e in st.recomputed for u in live.units[a:e])
                      for st in result.evaluation.stages]
        moved = ""
        if all(r is Recompute.NONE for r in recomputes):
            bounds, moved = _refined(bounds, form, nodes, specs, ranks, link, kind, microbatches,
                                     stages_per_rank, data_parallel)
        record = Solver(
            method=Partitioner.ILP, solve_ms=result.solve_ms, optimal=result.optimal,
            detail=result.detail + moved,
        )
    facts = build_stages(
        nodes, live, bounds, devices=specs, link=link, schedule=kind, microbatches=microbatches,
        recompute=recomputes, recomputed=recomputed, stages_per_rank=stages_per_rank,
        data_parallel=data_parallel,
    )
    _check_rank_memory(facts.stages, ranks, kind)
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


def _refined(
    bounds: Sequence[int], form: Formulation, nodes: Sequence[NodeCost], specs: Sequence[DeviceSpec],
    ranks: Sequence[DeviceSpec], link: Link, kind: ScheduleKind, microbatches: int,
    stages_per_rank: int, data_parallel: DataParallel | None,
) -> tuple[tuple[int, ...], str]:
    """With several stages per rank (interleaved, ZBV) the solvers' objective, the slowest
    stage, is only a proxy for the step, and their memory check is per stage while a rank's
    stages share its memory: the cuts are moved among module boundaries while the simulated
    step falls (a split whose rank does not fit, or with a stage holding no parameter, counts as
    infinitely slow, so one that does not fit is moved to one that does where a single cut's
    move finds it). Returns the bounds
    and a note for the solver's detail (empty if nothing moved)."""
    if len(bounds) - 1 <= len(ranks):
        return tuple(bounds), ""

    holds = form.problem.holds_params

    def step(b: Sequence[int]) -> float:
        if any(holds) and not all(any(holds[i:j]) for i, j in itertools.pairwise(b)):
            return math.inf  # a stage without parameters: the solvers' constraint holds here too
        return _simulated_step(nodes, form.live, b, specs, ranks, link, kind, microbatches,
                               stages_per_rank, data_parallel)

    refined, after = refine_cuts(bounds, block_cuts(form.modules, form.problem.allowed_cuts()), step)
    if refined == tuple(bounds):
        return refined, ""
    return refined, f", then cuts moved to shorten the simulated step ({step(bounds):.1f} -> {after:.1f} ms)"


def _simulated_step(
    nodes: Sequence[NodeCost], live: Any, bounds: Sequence[int], specs: Sequence[DeviceSpec],
    ranks: Sequence[DeviceSpec], link: Link, kind: ScheduleKind, microbatches: int,
    stages_per_rank: int, data_parallel: DataParallel | None,
) -> float:
    """The step a split would take, simulated; inf if a stage or a rank would not fit."""
    facts = build_stages(
        nodes, live, list(bounds), devices=specs, link=link, schedule=kind, microbatches=microbatches,
        stages_per_rank=stages_per_rank, data_parallel=data_parallel,
    )
    if any(d.memory_bytes is not None and st.peak_memory_bytes > d.memory_bytes for st, d in zip(facts.stages, specs)):
        return math.inf
    try:
        _check_rank_memory(facts.stages, ranks, kind)
    except PartitionError:
        return math.inf
    return float(facts.predicted.step_ms)


def _check_rank_memory(stages: Sequence[Stage], ranks: Sequence[DeviceSpec], kind: ScheduleKind) -> None:
    """The stages a rank runs share its memory. The solvers fit each stage within its device's
    capacity on its own; with several stages per rank (interleaved, ZBV) their peaks together
    (an upper bound: they need not coincide) must fit too, or the plan is refused."""
    k = len(ranks)
    if len(stages) == k:
        return
    for r, spec in enumerate(ranks):
        mine = stages_on(r, k, len(stages), kind.placement)
        need = sum(stages[s].peak_memory_bytes for s in mine)
        if spec.memory_bytes is not None and need > spec.memory_bytes:
            raise PartitionError(
                f"rank {r} ({spec.name}) runs stages {list(mine)} of the {kind.value} schedule, "
                f"which together need {need / 2**20:.1f} MiB at their peaks, over its "
                f"{spec.memory_bytes / 2**20:.1f} MiB; use one stage per rank (schedule='1f1b' "
                f"or 'zero-bubble'), more devices or more memory"
            )


def _stages_per_rank(kind: ScheduleKind, asked: int) -> int:
    """The stages per rank ``kind`` runs: ``asked`` for interleaved 1F1B, 1 for the other
    one-stage schedules, and ZBV's fixed 2 (where 1, the default, means "as the schedule runs")."""
    fixed = kind.fixed_stages_per_rank
    if fixed is not None and asked in (1, fixed):
        return fixed
    if asked < 1 or (asked > 1 and kind is not ScheduleKind.INTERLEAVED_1F1B):
        runs = f"{kind.value} runs {fixed} stages per rank" if fixed else (
            "several stages per rank need schedule='interleaved-1f1b'")
        raise InputError(f"stages_per_rank={asked}: {runs}; use {fixed or 1} otherwise")
    return asked


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
