"""What fits: the least memory per device any split needs, and an error that says what would fit.

``min_peak_memory`` is an exact dynamic program over the chain (minimise the largest stage
memory, each stage taking recompute where allowed). It answers "nothing fits" with numbers: the
smallest memory per device that fits K stages, and the fewest devices of the given size that fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from pipecut.errors import PartitionError
from pipecut.passes.partition.problem import Problem

__all__ = ["infeasible_error", "min_peak_memory"]


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def min_peak_memory(
    problem: Problem, positions: Sequence[int] | None = None, *, relative: bool = False
) -> tuple[float, tuple[int, ...]]:
    """(least possible largest stage memory, the split that achieves it).

    Bytes, capacities ignored; with ``relative`` the fraction of each stage's capacity (a split
    fits when it is at most 1). ``positions`` restricts the cuts (default: every allowed cut);
    restricting can only raise the answer, so it stays an amount that fits.
    """
    p, k, n = problem, problem.stages, problem.units
    cuts = [0, *sorted(set(p.allowed_cuts() if positions is None else positions)), n]
    pos = np.asarray(cuts, dtype=np.int64)
    fixed = np.concatenate([[0.0], np.cumsum(np.asarray(p.fixed_bytes, dtype=np.float64))])
    act = np.concatenate([[0.0], np.cumsum(np.asarray(p.activation_bytes, dtype=np.float64))])
    inb = np.asarray(p.input_bytes, dtype=np.float64)
    m = len(cuts)
    best = np.full((k + 1, m), np.inf)
    choice = np.zeros((k + 1, m), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, k + 1):
        for jj in range(s, m - (k - s)) if s < k else (m - 1,):
            ii = np.arange(s - 1, jj)
            i, j = pos[ii], pos[jj]
            kept = inb[i] if p.recompute else inb[i] + act[j] - act[i]
            mem = fixed[j] - fixed[i] + p.inflight[s - 1] * kept
            if relative:
                cap = p.capacities[s - 1]
                mem = mem / cap if cap is not None else mem * 0.0
            total = np.maximum(best[s - 1, ii], mem)
            x = int(np.argmin(total))
            best[s, jj] = total[x]
            choice[s, jj] = ii[x]
    if not np.isfinite(best[k, m - 1]):
        return float("inf"), ()
    bounds = [m - 1]
    for s in range(k, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    return float(best[k, m - 1]), tuple(int(pos[b]) for b in reversed(bounds))


def infeasible_error(
    problem: Problem,
    *,
    inflight_for: Callable[[int], Sequence[int]],
    positions: Sequence[int] | None = None,
    max_devices: int = 32,
) -> PartitionError:
    """The error for "no split fits", naming the memory per device and device count that would."""
    k, n = problem.stages, problem.units
    caps = [c for c in problem.capacities if c is not None]
    smallest = min(caps) if caps else float("inf")
    need, _ = min_peak_memory(problem, positions)
    how = "even with recompute" if problem.recompute else "without recompute"
    msg = (
        f"no split of {n} nodes into {k} stages fits in the device memory "
        f"({', '.join(_human(c) if c is not None else 'unlimited' for c in problem.capacities)}) "
        f"{how}; {k} devices would need {_human(need)} each"
    )
    limit = min(n, 4 * k, max_devices)
    for more in range(k + 1, limit + 1):
        bigger = dataclasses.replace(
            problem,
            speeds=(1.0,) * more,
            capacities=(smallest,) * more,
            inflight=tuple(inflight_for(more)),
        )
        if min_peak_memory(bigger, positions)[0] <= smallest:
            msg += f", or use {more} devices of {_human(smallest)}"
            break
    else:
        msg += f"; up to {limit} devices of {_human(smallest)} do not fit either"
    if not problem.recompute:
        msg += "; or allow recompute (PartitionOptions(recompute='full'))"
    return PartitionError(msg)
