"""Move cuts to shorten the simulated step, where the partitioner's objective is only a proxy.

The exact DP minimises the slowest stage. With one stage per rank that is what bounds the step;
with several stages per rank (interleaved 1F1B, ZBV) a rank runs the sum of its stages, in an
order the schedule fixes, and the split with the least slowest stage can take a longer step
than another (measured: ResNet example, 4 stages on 2 ranks, 18% behind the best split at block
boundaries). This pass starts from the DP's cuts and moves one cut at a time to the candidate
position that gives the shortest step as ``evaluate`` simulates it, sweeping until no move helps
(coordinate descent: a local optimum of the step itself, never worse than where it started).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

__all__ = ["refine_cuts"]


def refine_cuts(
    bounds: Sequence[int],
    candidates: Sequence[int],
    evaluate: Callable[[tuple[int, ...]], float],
    max_sweeps: int = 4,
) -> tuple[tuple[int, ...], float]:
    """``bounds`` (0, cuts..., N) with each interior cut moved among ``candidates`` (and its own
    position) while ``evaluate(bounds)`` (the simulated step; inf where a split is not allowed)
    falls. Returns the bounds and their value."""
    best = tuple(bounds)
    value = evaluate(best)
    positions = sorted(set(candidates) | set(best[1:-1]))
    for _ in range(max_sweeps):
        moved = False
        for i in range(1, len(best) - 1):
            for b in positions:
                if not best[i - 1] < b < best[i + 1] or b == best[i]:
                    continue
                trial = (*best[:i], b, *best[i + 1:])
                v = evaluate(trial)
                if v < value - 1e-9 and math.isfinite(v):
                    best, value, moved = trial, v, True
        if not moved:
            break
    return best, value
