"""pipecut.passes.partition.refine: coordinate descent of cuts on a simulated step."""

from __future__ import annotations

import itertools
import math

from pipecut.passes.partition.refine import refine_cuts


def _ranks_of_four(costs: list[float]):  # type: ignore[no-untyped-def]
    """4 stages on 2 ranks (s mod 2): the busier rank's total, a stand-in for a simulated step."""
    prefix = list(itertools.accumulate(costs, initial=0.0))

    def step(bounds: tuple[int, ...]) -> float:
        stage = [prefix[b] - prefix[a] for a, b in itertools.pairwise(bounds)]
        if min(stage) <= 0:
            return math.inf
        return max(stage[0] + stage[2], stage[1] + stage[3])

    return step


def test_moves_cuts_to_a_shorter_step_and_never_ends_worse() -> None:
    costs = [5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 5.0]
    step = _ranks_of_four(costs)
    start = (0, 1, 2, 7, 8)  # stage 2 holds six units: rank 0 carries 11 of 16
    bounds, value = refine_cuts(start, range(1, 8), step)
    assert value == step(bounds) < step(start)
    best = min(step((0, *c, 8)) for c in itertools.combinations(range(1, 8), 3))
    assert value == best == 8.0


def test_keeps_the_start_when_no_candidate_helps_and_skips_forbidden_splits() -> None:
    step = _ranks_of_four([1.0] * 8)
    start = (0, 2, 4, 6, 8)
    assert refine_cuts(start, [1, 3, 5, 7], step) == (start, 4.0)
    calls: list[tuple[int, ...]] = []
    refine_cuts(start, [2], lambda b: calls.append(b) or 1.0)  # type: ignore[func-returns-value]
    assert calls == [start]  # no cut may pass its neighbours or stay put as a "move"
