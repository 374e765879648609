"""Memory-aware partition of a chain as an integer linear program (pulp + HiGHS or CBC).

Variables, for the K - 1 cuts ``s = 1..K-1`` and the positions ``p`` cut ``s`` may take:

    c[s, p] ∈ {0, 1}     stage s starts at unit p           Σ_p c[s, p] = 1
    r[s]    ∈ {0, 1}     stage s recomputes its forward     (only where it may help: a capacity)
    T ≥ 0                the slowest stage's time per microbatch (minimised)

With ``at(A, s) = Σ_p A[p]·c[s, p]`` (``A[0]`` for s = 0 and ``A[N]`` for s = K) any prefix sum
over the units of stage s is ``at(A, s+1) - at(A, s)``, so each stage is a few linear terms:

    pos(s+1) ≥ pos(s) + 1                                        non-empty stages in unit order
    at(holders, s+1) - at(holders, s) ≥ 1                        a parameter on every stage
    T ≥ Δcompute_s / speed_s + at(boundary, s) + at(boundary, s+1) + R_s
    R_s ≥ Δforward_s / speed_s - F·(1 - r_s),  R_s ≥ 0            recompute time
    (Δfixed_s + inflight_s·(at(input, s) + A_s)) / cap_s ≤ 1     memory
    A_s ≥ Δactivation_s - Amax·r_s,  A_s ≥ 0                     kept activations

Stage order follows the topological unit order, which respects every data dependency, and the
answer is a set of contiguous ranges, which is what the split pass and the runtime execute.
Windows restrict each cut to a subset of positions; that is how coarsening and refinement
(see :mod:`pipecut.passes.partition.coarsen`) keep the program small.

The program is solved by HiGHS (the ``highspy`` package, in process) or by CBC (the binary
bundled with PuLP, which PuLP deprecates for 4.0); :class:`IlpSolver` picks one.
``benchmarks/ilp_solvers.py`` compares them on the partition benchmark's problems.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pulp

from pipecut.options import IlpSolver
from pipecut.passes.partition.holders import holder_prefix
from pipecut.passes.partition.problem import Evaluation, Problem, evaluate

__all__ = ["IlpResult", "IlpStatus", "default_windows", "solve_ilp"]


class IlpStatus(enum.Enum):
    OPTIMAL = "optimal"
    """The solver proved the solution optimal over the allowed cut positions."""
    FEASIBLE = "feasible"
    """The time limit was hit with a solution in hand."""
    INFEASIBLE = "infeasible"
    """No split over the allowed positions fits in memory."""
    NO_SOLUTION = "no_solution"
    """The time limit was hit before any solution was found."""


@dataclass(frozen=True, kw_only=True, slots=True)
class IlpResult:
    status: IlpStatus
    evaluation: Evaluation | None
    solve_ms: float
    binaries: int


def default_windows(problem: Problem, positions: Sequence[int] | None = None) -> list[list[int]]:
    """For each cut 1..K-1, the candidate positions that leave room for the other stages."""
    cand = sorted(set(problem.allowed_cuts() if positions is None else positions))
    k = problem.stages
    return [cand[s - 1 : len(cand) - (k - 1 - s)] for s in range(1, k)]


def _prefix(values: Sequence[float]) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(values, dtype=np.float64))])


def solve_ilp(
    problem: Problem,
    *,
    windows: Sequence[Sequence[int]] | None = None,
    time_limit_s: float | None = 10.0,
    warm_start: Sequence[int] | None = None,
    solver: IlpSolver = IlpSolver.HIGHS,
) -> IlpResult:
    """Minimise the slowest stage subject to memory, with a recompute choice per stage."""
    p, k = problem, problem.stages
    wins = [sorted(set(w)) for w in (windows if windows is not None else default_windows(p))]
    if len(wins) != k - 1:
        raise ValueError(f"{k} stages need {k - 1} windows of cut positions, got {len(wins)}")
    start = time.perf_counter()
    if any(not w for w in wins) or any(c is not None and c <= 0 for c in p.capacities):
        return IlpResult(status=IlpStatus.INFEASIBLE, evaluation=None, solve_ms=0.0, binaries=0)
    lp = pulp.LpProblem("pipecut_partition", pulp.LpMinimize)
    cut = [
        {b: lp.add_variable(f"c_{s}_{b}", cat=pulp.LpBinary) for b in wins[s - 1]}
        for s in range(1, k)
    ]
    top = lp.add_variable("T", lowBound=0)
    lp += top
    _add_order(lp, p, cut)
    sums = _Sums.of(p)
    recompute_vars = {}
    for s in range(k):
        r = _add_stage(lp, p, cut, sums, s, top)
        if r is not None:
            recompute_vars[s] = r
    warm = _set_warm_start(problem, cut, recompute_vars, warm_start)
    lp.solve(_pulp_solver(solver, time_limit_s, warm))
    solve_ms = (time.perf_counter() - start) * 1e3
    return _result(lp, problem, cut, solve_ms, sum(len(c) for c in cut) + len(recompute_vars))


@dataclass(frozen=True, kw_only=True, slots=True)
class _Sums:
    """The problem's prefix sums over units (and the boundary time per position), the ``A`` the
    constraints take ``at`` the cuts."""

    compute: np.ndarray
    forward: np.ndarray
    fixed: np.ndarray
    act: np.ndarray
    boundary: list[float]

    @staticmethod
    def of(p: Problem) -> _Sums:
        n = p.units
        return _Sums(
            compute=_prefix(p.compute_ms), forward=_prefix(p.forward_ms),
            fixed=_prefix(p.fixed_bytes), act=_prefix(p.activation_bytes),
            boundary=[0.0 if b in (0, n) else p.boundary_ms[b] for b in range(n + 1)],
        )


def _at(
    cut: list[dict[int, pulp.LpVariable]], n: int, values: Sequence[float] | np.ndarray, s: int
) -> pulp.LpAffineExpression:
    """``at(A, s)``: the value of ``values`` at where stage s starts (a constant for 0 and K)."""
    if s == 0:
        return pulp.LpAffineExpression(constant=float(values[0]))
    if s == len(cut) + 1:
        return pulp.LpAffineExpression(constant=float(values[n]))
    return pulp.lpSum(float(values[b]) * v for b, v in cut[s - 1].items())


def _add_order(lp: pulp.LpProblem, p: Problem, cut: list[dict[int, pulp.LpVariable]]) -> None:
    """One position per cut, non-empty stages in unit order, a parameter on every stage."""
    k, n = p.stages, p.units
    positions = list(range(n + 1))
    for s in range(1, k):
        lp += pulp.lpSum(cut[s - 1].values()) == 1, f"one_cut_{s}"
    for s in range(1, k - 1):
        lp += _at(cut, n, positions, s + 1) - _at(cut, n, positions, s) >= 1, f"order_{s}"
    if any(p.holds_params):  # (without it every unit counts and this is the order constraint)
        holders = holder_prefix(p.holds_params, n)
        for s in range(k):
            lp += _at(cut, n, holders, s + 1) - _at(cut, n, holders, s) >= 1, f"holds_params_{s}"


def _add_stage(
    lp: pulp.LpProblem,
    p: Problem,
    cut: list[dict[int, pulp.LpVariable]],
    sums: _Sums,
    s: int,
    top: pulp.LpVariable,
) -> pulp.LpVariable | None:
    """Stage s's time under ``top`` and its memory under its capacity; its recompute variable
    ``r_s`` where it has a capacity and may recompute, else None."""
    n = p.units

    def delta(values: Sequence[float] | np.ndarray) -> pulp.LpAffineExpression:
        return _at(cut, n, values, s + 1) - _at(cut, n, values, s)

    speed, cap = p.speeds[s], p.capacities[s]
    stage_time = delta(sums.compute) * (1.0 / speed)
    stage_time += _at(cut, n, sums.boundary, s) + _at(cut, n, sums.boundary, s + 1)
    kept = delta(sums.act)
    r = None
    if cap is not None and p.recompute:
        r = lp.add_variable(f"r_{s}", cat=pulp.LpBinary)
        extra = lp.add_variable(f"R_{s}", lowBound=0)
        big_f = float(sums.forward[n]) / speed
        lp += extra >= delta(sums.forward) * (1.0 / speed) - big_f * (1 - r)
        stage_time += extra
        kept_var = lp.add_variable(f"A_{s}", lowBound=0)
        lp += kept_var >= kept - float(sums.act[n]) * r, f"kept_{s}"
        kept = kept_var
    if cap is not None:
        mem = delta(sums.fixed) + p.inflight[s] * (_at(cut, n, p.input_bytes, s) + kept)
        lp += mem * (1.0 / cap) <= 1, f"memory_{s}"
    lp += top >= stage_time, f"time_{s}"
    return r


def _result(
    lp: pulp.LpProblem, problem: Problem, cut: list[dict[int, pulp.LpVariable]], solve_ms: float,
    binaries: int,
) -> IlpResult:
    """The solved program's status and split, evaluated on ``problem``."""
    if lp.status == pulp.LpStatusInfeasible or lp.sol_status == pulp.LpSolutionInfeasible:
        return IlpResult(
            status=IlpStatus.INFEASIBLE, evaluation=None, solve_ms=solve_ms, binaries=binaries
        )
    bounds = _read_bounds(cut, problem.units)
    if bounds is None:
        return IlpResult(
            status=IlpStatus.NO_SOLUTION, evaluation=None, solve_ms=solve_ms, binaries=binaries
        )
    ev = evaluate(problem, bounds)
    status = IlpStatus.OPTIMAL if lp.sol_status == pulp.LpSolutionOptimal else IlpStatus.FEASIBLE
    return IlpResult(status=status, evaluation=ev, solve_ms=solve_ms, binaries=binaries)


class _WarmHiGHS(pulp.HiGHS):
    """PuLP's HiGHS interface, handed the variables' initial values as a starting solution.

    PuLP passes a warm start to CBC but not to HiGHS; ``Highs.setSolution`` takes one, and
    with it HiGHS begins from the DP's split instead of searching for a first one.
    """

    def callSolver(self, lp: pulp.LpProblem) -> None:
        # Only the binaries have initial values; HiGHS completes the rest (sparse solution).
        given = [v for v in lp.variables() if v.cat == pulp.LpInteger and v.varValue is not None]
        lp.solverModel.setSolution(
            len(given),
            np.array([v.index for v in given], dtype=np.int32),
            np.array([float(v.varValue) for v in given], dtype=np.float64),
        )
        super().callSolver(lp)


def _pulp_solver(kind: IlpSolver, time_limit_s: float | None, warm: bool) -> pulp.LpSolver:
    if kind is IlpSolver.HIGHS:
        cls = _WarmHiGHS if warm else pulp.HiGHS
        if not cls().available():
            raise RuntimeError(
                "the ILP solver HiGHS needs the highspy package: pip install highspy, or pass "
                "solver=IlpSolver.CBC"
            )
        return cls(msg=False, timeLimit=time_limit_s, gapRel=0.0, gapAbs=1e-9, threads=1)
    with warnings.catch_warnings():
        # PuLP 3.3 flags its bundled CBC as deprecated for 4.0: selectable, not the default.
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False, timeLimit=time_limit_s, warmStart=warm, gapRel=0.0, gapAbs=1e-9
        )


def _read_bounds(cut: list[dict[int, pulp.LpVariable]], n: int) -> tuple[int, ...] | None:
    bounds = [0]
    for c in cut:
        chosen = [b for b, v in c.items() if v.varValue is not None and v.varValue > 0.5]
        if len(chosen) != 1:
            return None
        bounds.append(chosen[0])
    bounds.append(n)
    if any(a >= b for a, b in itertools.pairwise(bounds)):
        return None
    return tuple(bounds)


def _set_warm_start(
    problem: Problem,
    cut: list[dict[int, pulp.LpVariable]],
    recompute_vars: dict[int, pulp.LpVariable],
    bounds: Sequence[int] | None,
) -> bool:
    """Give CBC a starting split when it lies in the windows and fits; True if one was set."""
    if bounds is None or len(bounds) != problem.stages + 1:
        return False
    if any(bounds[s] not in cut[s - 1] for s in range(1, problem.stages)):
        return False
    ev = evaluate(problem, bounds)
    if not ev.fits or not math.isfinite(ev.bottleneck_ms):
        return False
    for s, c in enumerate(cut, start=1):
        for b, v in c.items():
            v.setInitialValue(1 if b == bounds[s] else 0)
    for s, r in recompute_vars.items():
        r.setInitialValue(1 if ev.stages[s].recompute.value == "full" else 0)
    return True
