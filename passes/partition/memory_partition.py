"""The memory-aware partitioner end to end: exact bounded DP, ILP over candidate cuts, errors.

1. :func:`~pipecut.passes.partition.memory_dp.partition_bounded` finds the optimal split over every allowed
   cut position (speeds, memory and recompute included) in well under a second for thousands
   of units, or shows that nothing fits.
2. The ILP (:func:`~pipecut.passes.partition.ilp.solve_ilp`) runs over every position when there are at
   most ``max_positions``, else over the candidate cuts of
   :func:`~pipecut.passes.partition.coarsen.candidate_cuts` plus the DP's cuts, warm-started from the DP's
   split. The solver (HiGHS by default, or CBC) either proves that split optimal over those positions or stops at its time limit;
   the plan records which. The two are independent solvers of one model, so a disagreement is
   reported in the plan's solver detail rather than hidden. One part of the model is the DP's
   alone: recomputing single blocks of a stage (``Recompute.SELECTIVE``); the ILP chooses only
   between no recompute and the whole stage's, so where blocks pay it can only come out slower.
3. Nothing fits: :func:`~pipecut.passes.partition.memory_floor.infeasible_error` names the memory per device and
   the device count that would.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipecut.core.kinds import Recompute
from pipecut.errors import PartitionError
from pipecut.passes.partition.coarsen import candidate_cuts
from pipecut.passes.partition.holders import stage_count_error
from pipecut.passes.partition.ilp import IlpResult, IlpSolver, IlpStatus, default_windows, solve_ilp
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_floor import infeasible_error
from pipecut.passes.partition.problem import Evaluation, Problem

__all__ = ["IlpPlan", "partition_ilp"]


@dataclass(frozen=True, kw_only=True, slots=True)
class IlpPlan:
    evaluation: Evaluation
    optimal: bool
    """True when the ILP solver proved the split optimal over the positions it was given."""
    solve_ms: float
    detail: str


def partition_ilp(
    problem: Problem,
    *,
    modules: Sequence[str] = (),
    inflight_for: Callable[[int], Sequence[int]] | None = None,
    time_limit_s: float = 5.0,
    max_positions: int = 240,
    solver: IlpSolver = IlpSolver.HIGHS,
) -> IlpPlan:
    """Fastest split that fits, with a recompute choice per stage; PartitionError if none fits.

    ``modules`` are the units' module paths (for coarsening); ``inflight_for(k)`` gives the
    inflight microbatches per stage for k stages (for the error that says how many devices fit).
    """
    start = time.perf_counter()
    k, allowed = problem.stages, problem.allowed_cuts()
    _check_stage_count(problem, allowed)
    coarse = _coarse_positions(problem, allowed, modules, max_positions)
    exact = partition_bounded(problem, coarse=coarse if coarse is not allowed else ())
    if exact is None:
        raise infeasible_error(
            problem,
            inflight_for=inflight_for or (lambda m: [max(problem.inflight)] * m),
            positions=None if coarse is allowed else coarse,
        )
    dp_ms = (time.perf_counter() - start) * 1e3
    if k == 1:
        return IlpPlan(evaluation=exact, optimal=True, solve_ms=dp_ms, detail="one stage")
    positions = sorted({*coarse, *exact.bounds[1:-1]})
    res = solve_ilp(
        problem,
        windows=default_windows(problem, positions),
        time_limit_s=time_limit_s,
        warm_start=exact.bounds,
        solver=solver,
    )
    best = exact
    ilp = res.evaluation
    if ilp is not None and ilp.fits and ilp.bottleneck_ms < exact.bottleneck_ms * (1 - 1e-9):
        best = ilp  # only possible if the DP were wrong; keep the better split
    return IlpPlan(
        evaluation=best,
        optimal=res.status is IlpStatus.OPTIMAL,
        solve_ms=(time.perf_counter() - start) * 1e3,
        detail=_detail(exact, res, len(allowed), len(positions), dp_ms, solver),
    )


def _check_stage_count(problem: Problem, allowed: Sequence[int]) -> None:
    """PartitionError if the graph has too few places to cut, or too few units holding
    parameters, for ``problem.stages`` stages."""
    k, n = problem.stages, problem.units
    if k - 1 > len(allowed):
        raise PartitionError(
            f"cannot cut this graph into {k} stages: it has {n} partitionable nodes and only "
            f"{len(allowed)} places where every live value can cross a cut; "
            f"use at most {len(allowed) + 1} devices"
        )
    too_many = stage_count_error(k, problem.holds_params, allowed)
    if too_many is not None:
        raise too_many


def _coarse_positions(
    problem: Problem, allowed: Sequence[int], modules: Sequence[str], max_positions: int
) -> Sequence[int]:
    """``allowed`` itself when there are at most ``max_positions``, else the candidate cuts."""
    if len(allowed) <= max_positions:
        return allowed
    return candidate_cuts(
        modules or ("",) * problem.units,
        problem.compute_ms,
        problem.boundary_ms,
        max_positions=max_positions,
    )


def _detail(
    exact: Evaluation, res: IlpResult, allowed: int, positions: int, dp_ms: float,
    solver: IlpSolver,
) -> str:
    """What the plan's solver detail says: the DP, the ILP over how many of the ``allowed``
    positions, and whether the two agree."""
    agree = res.evaluation is not None and abs(
        res.evaluation.bottleneck_ms - exact.bottleneck_ms
    ) <= 1e-6 * max(exact.bottleneck_ms, 1e-9)
    scope = (
        f"all {allowed} cut positions"
        if positions >= allowed
        else f"{positions} of {allowed} cut positions (module boundaries + DP cuts)"
    )
    detail = (
        f"exact bounded DP over all {allowed} cut positions in {dp_ms:.0f} ms; "
        f"ILP ({solver.name}, {res.binaries} binaries) over {scope}: {res.status.value} in "
        f"{res.solve_ms:.0f} ms, " + ("agrees with the DP" if agree else "differs from the DP")
    )
    blocks = [s for s, st in enumerate(exact.stages) if st.recompute is Recompute.SELECTIVE]
    if blocks and not agree:
        detail += (f" (the ILP models whole-stage recompute only; the DP's split recomputes "
                   f"single blocks on stage(s) {blocks})")
    return detail
