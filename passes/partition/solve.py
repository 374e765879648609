"""Partition a cost table into stages: cost table in, plan out (the pass behind ``pipecut.partition_costs``).

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

from pipecut.cluster import Link
from pipecut.core.choices import enum_choice
from pipecut.core.kinds import CaptureMethod, Partitioner, Recompute, ScheduleKind
from pipecut.errors import InputError, PartitionError
from pipecut.ir import DeviceSpec, NodeCost, Plan, Solver, Stage
from pipecut.options import AUTO, DataParallelOptions, IlpSolver, PartitionOptions
from pipecut.passes.costs.stages import build_stages, inflight_microbatches
from pipecut.passes.partition.chain import boundary_bytes, can_cross, is_unit, liveness
from pipecut.passes.partition.coarsen import block_cuts, candidate_cuts
from pipecut.passes.partition.holders import stage_count_error
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_floor import infeasible_error
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.pinned import (
    bounds_from_modules,
    bounds_from_split_points,
    is_split_points,
)
from pipecut.passes.partition.problem import Formulation, formulate
from pipecut.passes.partition.rebuild import mark_rebuilt
from pipecut.passes.partition.refine import refine_cuts
from pipecut.schedules.format import rank_of, stages_on
from pipecut.version import __version__

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


def _allows_recompute(recompute: Recompute | str, specs: Sequence[DeviceSpec]) -> bool:
    """Whether the partitioner may recompute: "auto" where a device has a memory capacity."""
    if recompute == AUTO:
        return any(d.memory_bytes is not None for d in specs)
    if recompute is Recompute.SELECTIVE:
        raise InputError(
            "PartitionOptions(recompute='selective') fixes the level of a cluster plan; the "
            "partitioner chooses selective blocks or whole stages per stage where memory needs "
            "it: allow that with recompute='full', or forbid it with recompute='none'")
    return recompute is Recompute.FULL


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
    partition: PartitionOptions | None = None,
    stages_per_rank: int = 1,
    data_parallel: DataParallelOptions | None = None,
    fingerprint: str = "",
    capture: CaptureMethod = CaptureMethod.SYMBOLIC_TRACE,
    inputs: Sequence[str] = (),
) -> Plan:
    """Partition a cost table (pure data) into a plan: set the problem up, cut it (a split
    given, the exact DP or the ILP), and build the plan's stages and prediction.

    ``devices`` are the ranks; with ``stages_per_rank`` V > 1 (interleaved schedules) the graph
    is cut into K * V stages and stage s runs on device s mod K. ZBV always cuts 2K stages
    (``stages_per_rank`` 1, the default, or 2), rank r running stages r and 2K - 1 - r.

    ``partition`` (:class:`~pipecut.options.PartitionOptions`): ``recompute`` how much a stage
    may recompute of its forward in backward to fit in memory ("auto": where some device has a
    memory capacity); ``partitioner`` None picks the exact DP for equal devices without memory limits
    or recompute and the ILP otherwise, DP or ILP forces one; ``ilp_time_limit`` seconds the ILP
    may spend in total (the plan's solver record says whether it proved its answer optimal);
    ``solver`` HiGHS (default) or CBC; ``split`` pins the split instead, module FQNs per stage
    (``[["emb", "blocks.0"], ["blocks.1", "head"]]``) or the modules where stages 1.. begin
    (``["blocks.1"]``), and the plan then reports pipecut's own optimum beside it
    (``predicted.optimum_step_ms``).

    Values that are cheaper to compute again from the inputs than to send over ``link`` (a
    causal mask, rotary tables) cross no cut: the plan's cost table marks them ``rebuilt``
    (:func:`pipecut.passes.partition.rebuild.mark_rebuilt`).

    Args:
        nodes: The cost table, in topological order (a plan's ``nodes``).
        devices: K, a list of devices, or :class:`~pipecut.ir.DeviceSpec` s (the ranks).
        microbatches: Microbatches per step.
        batch_size: The whole batch's size (a multiple of ``microbatches``).
        schedule: A :class:`~pipecut.core.kinds.ScheduleKind` or its name.
        link: The link between neighbouring stages.
        partition: :class:`~pipecut.options.PartitionOptions`, as above; None: the defaults.
        stages_per_rank: Virtual stages per rank (interleaved schedules, ZBV).
        data_parallel: The replicas each stage will have and their engine, resolved; FSDP
            shrinks the memory a stage needs (see
            :func:`pipecut.passes.costs.stages.state_bytes`).
        fingerprint: The captured graph's fingerprint, recorded in the plan.
        capture: How the graph was captured, recorded in the plan.
        inputs: The graph's input placeholder names, in order.

    Returns:
        The :class:`~pipecut.ir.Plan`: stages, cut edges, schedule and prediction.

    Raises:
        InputError: An unknown schedule or device, or stages that do not divide over the ranks.
        PartitionError: No split fits the devices' memory, or the split given names unknown
            modules.
    """
    options = partition or PartitionOptions()
    nodes = mark_rebuilt(nodes, link)  # what a stage computes again rather than receives
    setup = _Setup.of(nodes, devices, microbatches, batch_size, schedule, link, options, stages_per_rank,
                      data_parallel)
    if options.split is not None:
        cut = _given_split(setup, options.split)
    elif setup.method is Partitioner.DP:
        cut = _exact(setup)
    else:
        cut = _ilp(setup)
    facts = build_stages(
        nodes, cut.live, cut.bounds, devices=setup.specs, link=link, schedule=setup.kind,
        microbatches=microbatches, recompute=cut.recomputes, recomputed=cut.recomputed,
        stages_per_rank=setup.stages_per_rank, data_parallel=data_parallel,
    )
    _check_rank_memory(facts.stages, setup.ranks, setup.kind)
    predicted = dataclasses.replace(facts.predicted, optimum_step_ms=cut.optimum_ms or facts.predicted.step_ms)
    return Plan(
        fingerprint=fingerprint, capture=capture, schedule=setup.kind, microbatches=microbatches,
        batch_size=batch_size, inputs=tuple(inputs), nodes=tuple(nodes), stages=facts.stages,
        edges=facts.edges, devices=setup.specs, link=link, predicted=predicted, solver=cut.record,
        tied=facts.tied, stages_per_rank=setup.stages_per_rank, data_parallel=data_parallel,
        pipecut_version=__version__, torch_version=torch.__version__,
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Setup:
    """One partitioning problem, its arguments normalised."""

    nodes: Sequence[NodeCost]
    kind: ScheduleKind
    ranks: tuple[DeviceSpec, ...]
    specs: tuple[DeviceSpec, ...]
    """The device of every stage (K × stages per rank)."""
    link: Link
    microbatches: int
    batch_size: int
    stages_per_rank: int
    data_parallel: DataParallelOptions | None
    options: PartitionOptions
    allow_recompute: bool
    method: Partitioner
    start: float
    """``time.perf_counter()`` when partitioning began."""

    @classmethod
    def of(cls, nodes: Sequence[NodeCost], devices: Devices, microbatches: int, batch_size: int,
           schedule: str | ScheduleKind, link: Link, options: PartitionOptions, stages_per_rank: int, data_parallel: DataParallelOptions | None) -> _Setup:
        kind = as_schedule(schedule)
        per_rank = _stages_per_rank(kind, stages_per_rank)
        ranks = as_devices(devices)
        specs = tuple(ranks[rank_of(s, len(ranks), kind.placement)] for s in range(len(ranks) * per_rank))
        allow = _allows_recompute(options.recompute, specs)
        method = (options.partitioner if options.partitioner != AUTO
                  else Partitioner.ILP if _use_ilp(specs, allow) else Partitioner.DP)
        if method is Partitioner.GIVEN:
            raise InputError("partitioner must be Partitioner.DP, Partitioner.ILP or None")
        return cls(nodes=nodes, kind=kind, ranks=ranks, specs=specs, link=link, microbatches=microbatches,
                   batch_size=batch_size, stages_per_rank=per_rank, data_parallel=data_parallel, options=options,
                   allow_recompute=allow, method=method, start=time.perf_counter())

    @property
    def stages(self) -> int:
        return len(self.specs)

    @property
    def units(self) -> int:
        return sum(1 for n in self.nodes if is_unit(n))

    def formulate(self, recompute: bool) -> Formulation:
        return formulate(self.nodes, devices=self.specs, link=self.link, schedule=self.kind,
                         microbatches=self.microbatches, recompute=recompute, data_parallel=self.data_parallel)

    def inflight(self, stages: int) -> Sequence[int]:
        """Microbatches in flight on each of ``stages`` stages under the schedule."""
        return inflight_microbatches(self.kind, stages, self.microbatches)

    def refined(self, bounds: Sequence[int], form: Formulation) -> tuple[tuple[int, ...], str]:
        return _refined(bounds, form, self.nodes, self.specs, self.ranks, self.link, self.kind,
                        self.microbatches, self.stages_per_rank, self.data_parallel)

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Cut:
    """Where a solver cut the chain, and its record."""

    live: Any
    bounds: tuple[int, ...]
    recomputes: list[Recompute]
    recomputed: list[tuple[str, ...]]
    """Per stage, the units recomputed under ``Recompute.SELECTIVE``."""
    record: Solver
    optimum_ms: float = 0.0
    """With a split given: pipecut's own optimum's step."""


def _given_split(setup: _Setup, split: Split) -> _Cut:
    """A split the user chose, scored beside pipecut's optimum."""
    live = liveness(setup.nodes)
    bounds = _given_bounds(setup.nodes, live, split, setup.stages, setup.link)
    optimum = partition_costs(
        setup.nodes, devices=setup.ranks, microbatches=setup.microbatches, batch_size=setup.batch_size,
        schedule=setup.kind, link=setup.link, partition=dataclasses.replace(setup.options, split=None),
        stages_per_rank=setup.stages_per_rank, data_parallel=setup.data_parallel,
    )
    record = Solver(method=Partitioner.GIVEN, solve_ms=setup.elapsed_ms(), optimal=False,
                    detail=f"split given: {_describe_split(split)}")
    return _Cut(live=live, bounds=tuple(bounds), recomputes=[Recompute.NONE] * setup.stages,
                recomputed=[()] * setup.stages, record=record, optimum_ms=optimum.predicted.step_ms)


def _exact(setup: _Setup) -> _Cut:
    """The exact DP over the whole cost model, pruned by a bound (10,000 units in 0.1 s); on
    large graphs a split over module boundaries first tightens the bound."""
    form = setup.formulate(recompute=False)
    k, cuts = setup.stages, form.problem.allowed_cuts()
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
              if setup.units > LARGE_GRAPH_UNITS else ())
    best = partition_bounded(form.problem, coarse=coarse)
    if best is None:
        raise infeasible_error(form.problem, inflight_for=setup.inflight, positions=coarse or None)
    bounds, moved = setup.refined(best.bounds, form)
    record = Solver(method=Partitioner.DP, solve_ms=setup.elapsed_ms(), optimal=True,
                    detail=f"exact DP over {setup.units} units{moved}")
    return _Cut(live=form.live, bounds=bounds, recomputes=[Recompute.NONE] * k, recomputed=[()] * k,
                record=record)


def _ilp(setup: _Setup) -> _Cut:
    """The memory-aware ILP over candidate cuts, recompute where allowed."""
    form = setup.formulate(recompute=setup.allow_recompute)
    result = partition_ilp(form.problem, modules=form.modules, inflight_for=setup.inflight,
                           time_limit_s=setup.options.ilp_time_limit, solver=setup.options.solver)
    bounds, recomputes = tuple(result.evaluation.bounds), list(result.evaluation.recompute)
    recomputed = [tuple(u for a, e in st.recomputed for u in form.live.units[a:e])
                  for st in result.evaluation.stages]
    moved = ""
    if all(r is Recompute.NONE for r in recomputes):
        bounds, moved = setup.refined(bounds, form)
    record = Solver(method=Partitioner.ILP, solve_ms=result.solve_ms, optimal=result.optimal,
                    detail=result.detail + moved)
    return _Cut(live=form.live, bounds=bounds, recomputes=recomputes, recomputed=recomputed, record=record)


def _refined(
    bounds: Sequence[int], form: Formulation, nodes: Sequence[NodeCost], specs: Sequence[DeviceSpec],
    ranks: Sequence[DeviceSpec], link: Link, kind: ScheduleKind, microbatches: int,
    stages_per_rank: int, data_parallel: DataParallelOptions | None,
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
    stages_per_rank: int, data_parallel: DataParallelOptions | None,
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
