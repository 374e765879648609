"""Exact dynamic program over the full problem (speeds, memory, recompute), pruned by a bound.

The plain DP (kept as the reference in ``tests/exact_dp.py``) looks at every (start, end) pair: O(K·N²), 13 s for
10,000 units. With an upper bound U on the answer most pairs are pointless: stage ``s`` can only
end at a unit ``j`` with

    prefix[j]          ≤ U · (speed_0 + … + speed_s)          (the first s+1 stages take ≤ U)
    total - prefix[j]  ≤ U · (speed_s+1 + … + speed_K-1)      (so do the rest)

and only start at ``i`` with ``prefix[j] - prefix[i] ≤ U · speed_s``. Starting from U a little
above the lower bound ``total / Σ speed`` and growing it until a split is found keeps the
answer exact (a split of bottleneck ≤ U is never pruned) and visits a sliver of the pairs.

Each stage takes its fastest option that fits (:func:`pipecut.passes.partition.problem.best_stage`), so this
is exact for the whole cost model, recompute included; tests check it against brute force. A
stage must also hold a parameter where the problem asks (:mod:`pipecut.passes.partition.holders`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pipecut.passes.partition.holders import holder_prefix
from pipecut.passes.partition.problem import Evaluation, Problem, best_stage, evaluate

__all__ = ["lower_bound", "partition_bounded"]


def _selective_ms(p: Problem, s: int, i: int, j: int, seen: dict[tuple[int, int, int], float]) -> float:
    """Time of stage ``s`` over ``[i, j)`` at its fastest recompute that fits (cached)."""
    if (s, i, j) not in seen:
        seen[(s, i, j)] = best_stage(p, s, i, j).time_ms
    return seen[(s, i, j)]


def _solve(
    problem: Problem, cuts: np.ndarray, bound: float, selective: dict[tuple[int, int, int], float]
) -> tuple[int, ...] | None:
    p, k, n = problem, problem.stages, problem.units
    pre = np.concatenate([[0.0], np.cumsum(np.asarray(p.compute_ms, dtype=np.float64))])
    fw = np.concatenate([[0.0], np.cumsum(np.asarray(p.forward_ms, dtype=np.float64))])
    fixed = np.concatenate([[0.0], np.cumsum(np.asarray(p.fixed_bytes, dtype=np.float64))])
    act = np.concatenate([[0.0], np.cumsum(np.asarray(p.activation_bytes, dtype=np.float64))])
    inb = np.asarray(p.input_bytes, dtype=np.float64)
    holders = holder_prefix(p.holds_params, n)
    bnd = np.asarray(p.boundary_ms, dtype=np.float64).copy()
    bnd[0] = bnd[n] = 0.0
    speeds = np.asarray(p.speeds, dtype=np.float64)
    before = np.cumsum(speeds)  # speed of stages 0..s
    after = before[-1] - before  # speed of stages s+1..K-1
    total = pre[n]
    slack = 1e-9 * max(total, 1.0)
    at = pre[cuts]  # prefix compute at each candidate position
    m = len(cuts)
    best = np.full((k + 1, m), np.inf)
    choice = np.zeros((k + 1, m), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(k):
        if s == k - 1:
            ends = np.array([m - 1])
        else:
            lo = np.searchsorted(at, total - bound * after[s] - slack, side="left")
            hi = np.searchsorted(at, bound * before[s] + slack, side="right")
            ends = np.arange(max(lo, s + 1), min(hi, m - (k - 1 - s)))
        reach = np.flatnonzero(best[s] <= bound)
        if reach.size == 0 or ends.size == 0:
            return None
        cap = p.capacities[s]
        for jj in ends:
            first = np.searchsorted(at, at[jj] - bound * speeds[s] - slack, side="left")
            ii = reach[(reach >= first) & (reach < jj)]
            if ii.size == 0:
                continue
            i, j = cuts[ii], cuts[jj]
            cost = (pre[j] - pre[i]) / speeds[s] + bnd[i] + bnd[j]
            if cap is not None:
                base = fixed[j] - fixed[i]
                fits = base + p.inflight[s] * (inb[i] + act[j] - act[i]) <= cap
                if p.recompute:
                    fits_rc = base + p.inflight[s] * inb[i] <= cap
                    redo = cost + (fw[j] - fw[i]) / speeds[s]
                    if p.block_cuts:  # some blocks only: a per-stage choice, done unit by unit
                        for pos in np.flatnonzero(~fits & fits_rc):
                            redo[pos] = _selective_ms(p, s, int(i[pos]), int(j), selective)
                    cost = np.where(fits, cost, np.where(fits_rc, redo, np.inf))
                else:
                    cost = np.where(fits, cost, np.inf)
            cost = np.where(holders[j] - holders[i] >= 1, cost, np.inf)
            worst = np.maximum(best[s, ii], cost)
            x = int(np.argmin(worst))
            if worst[x] <= bound:
                best[s + 1, jj] = worst[x]
                choice[s + 1, jj] = ii[x]
    if not np.isfinite(best[k, m - 1]):
        return None
    out = [m - 1]
    for s in range(k, 0, -1):
        out.append(int(choice[s, out[-1]]))
    return tuple(int(cuts[c]) for c in reversed(out))


def lower_bound(problem: Problem) -> float:
    """No split beats perfect balance of compute, nor the largest unit on the fastest device."""
    total = sum(problem.compute_ms)
    largest = max(problem.compute_ms, default=0.0)
    return max(total / sum(problem.speeds), largest / max(problem.speeds))


def _grow(
    problem: Problem, cuts: np.ndarray, start: float, growth: float
) -> tuple[int, ...] | None:
    """Solve with bound ``start``, growing it until a split is found or none can exist."""
    ceiling = sum(problem.compute_ms) / min(problem.speeds)
    ceiling += sum(problem.forward_ms) / min(problem.speeds) if problem.recompute else 0.0
    ceiling += 2 * max((b for b in problem.boundary_ms if np.isfinite(b)), default=0.0)
    bound = start
    selective: dict[tuple[int, int, int], float] = {}
    while True:
        bounds = _solve(problem, cuts, bound, selective)
        if bounds is not None or bound > ceiling:
            return bounds
        bound *= growth


def partition_bounded(
    problem: Problem,
    *,
    positions: Sequence[int] | None = None,
    coarse: Sequence[int] = (),
    growth: float = 1.25,
) -> Evaluation | None:
    """The optimal split over ``positions`` (default: every allowed cut); None if none fits.

    ``coarse``: a few hundred of the positions. A split over them is found first (cheaply) and
    its bottleneck bounds the exact search over all positions, which then runs once.
    """
    n, k = problem.units, problem.stages
    inner = problem.allowed_cuts() if positions is None else sorted(set(positions))
    if len(inner) < k - 1:
        return None
    start = max(lower_bound(problem), 1e-12) * 1.02
    if len(coarse) >= k - 1:
        rough = _grow(problem, np.asarray([0, *sorted(set(coarse)), n]), start, growth)
        if rough is not None:
            start = evaluate(problem, rough).bottleneck_ms * (1 + 1e-9)
    bounds = _grow(problem, np.asarray([0, *inner, n], dtype=np.int64), start, growth)
    return None if bounds is None else evaluate(problem, bounds)
