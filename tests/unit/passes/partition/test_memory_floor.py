"""pipecut.passes.partition.memory_floor: the least memory any split needs, and the error when none fits."""

from __future__ import annotations

import itertools
import random

import pytest

from pipecut.core.kinds import ScheduleKind
from pipecut.errors import PartitionError
from pipecut.passes.costs.stages import inflight_microbatches
from pipecut.passes.partition.memory_floor import infeasible_error, min_peak_memory
from pipecut.passes.partition.problem import Problem, stage_options


def problem(rng: random.Random, n: int, k: int, *, cap: float | None = None, recompute=False) -> Problem:
    return Problem(
        compute_ms=(1.0,) * n, forward_ms=(0.5,) * n, boundary_ms=(0.0,) * (n + 1),
        input_bytes=tuple(rng.randrange(0, 50) for _ in range(n + 1)),
        fixed_bytes=tuple(rng.randrange(0, 100) for _ in range(n)),
        activation_bytes=tuple(rng.randrange(0, 50) for _ in range(n)),
        speeds=(1.0,) * k, capacities=(cap,) * k,
        inflight=tuple(inflight_microbatches(ScheduleKind.ONE_F_ONE_B, k, 4)), recompute=recompute,
    )


def brute_force(p: Problem) -> float:
    best = float("inf")
    for cuts in itertools.combinations(range(1, p.units), p.stages - 1):
        b = (0, *cuts, p.units)
        worst = max(stage_options(p, s, b[s], b[s + 1])[-1].memory_bytes for s in range(p.stages))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(20))
def test_min_peak_memory_matches_brute_force(seed):
    rng = random.Random(seed)
    p = problem(rng, rng.randrange(2, 8), rng.randrange(1, 4), recompute=seed % 3 == 0)
    if p.stages > p.units:
        return
    need, bounds = min_peak_memory(p)
    assert need == pytest.approx(brute_force(p))
    assert bounds[0] == 0 and bounds[-1] == p.units and len(bounds) == p.stages + 1
    worst = max(stage_options(p, s, bounds[s], bounds[s + 1])[-1].memory_bytes for s in range(p.stages))
    assert worst == pytest.approx(need)  # the split it returns achieves it


def test_relative_memory_is_a_fraction_of_capacity():
    p = problem(random.Random(1), 6, 2, cap=1000.0)
    need, _ = min_peak_memory(p)
    assert min_peak_memory(p, relative=True)[0] == pytest.approx(need / 1000)
    assert min_peak_memory(p, positions=[3])[1] == (0, 3, 6)


def test_infeasible_error_names_what_would_fit():
    p = problem(random.Random(2), 12, 2, cap=60.0)
    error = infeasible_error(p, inflight_for=lambda k: inflight_microbatches(ScheduleKind.ONE_F_ONE_B, k, 4))
    assert isinstance(error, PartitionError)
    text = str(error)
    assert text.startswith("no split of 12 nodes into 2 stages fits in the device memory (60 B, 60 B) without recompute")
    assert "2 devices would need" in text and text.endswith("or allow recompute (PartitionOptions(recompute='full'))")
    assert "or use" in text or "do not fit either" in text
