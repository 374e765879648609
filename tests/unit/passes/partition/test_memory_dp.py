"""pipecut.passes.partition.memory_dp: the exact bounded DP agrees with brute force on small problems."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from pipecut.core.kinds import Recompute
from pipecut.passes.partition.memory_dp import lower_bound, partition_bounded
from pipecut.passes.partition.problem import Problem, evaluate


def random_problem(rng: random.Random, n: int, k: int, *, memory: bool) -> Problem:
    boundary = [0.0] + [rng.choice([rng.uniform(0, 1), math.inf]) if rng.random() < 0.2 else rng.uniform(0, 1)
                        for _ in range(n - 1)] + [0.0]
    fixed = tuple(rng.randrange(0, 100) for _ in range(n))
    caps = tuple(rng.choice([None, sum(fixed) / k * 1.6]) for _ in range(k)) if memory else (None,) * k
    return Problem(
        compute_ms=tuple(rng.uniform(0.1, 5) for _ in range(n)),
        forward_ms=tuple(rng.uniform(0.05, 2) for _ in range(n)),
        boundary_ms=tuple(boundary), input_bytes=tuple(rng.randrange(0, 30) for _ in range(n + 1)),
        fixed_bytes=fixed, activation_bytes=tuple(rng.randrange(0, 30) for _ in range(n)),
        speeds=tuple(rng.choice([1.0, 1.5]) for _ in range(k)), capacities=caps,
        inflight=tuple(range(k, 0, -1)), recompute=memory and rng.random() < 0.5,
    )


def brute_force(p: Problem) -> float | None:
    best = None
    for cuts in itertools.combinations(p.allowed_cuts(), p.stages - 1):
        e = evaluate(p, (0, *cuts, p.units))
        if e.fits and (best is None or e.bottleneck_ms < best):
            best = e.bottleneck_ms
    return best


@pytest.mark.parametrize("seed", range(30))
def test_bounded_matches_brute_force(seed):
    rng = random.Random(seed)
    p = random_problem(rng, rng.randrange(3, 9), rng.randrange(1, 4), memory=seed % 2 == 1)
    expected = brute_force(p)
    got = partition_bounded(p)
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.fits
        assert got.bottleneck_ms == pytest.approx(expected, rel=1e-9)
        assert got.bottleneck_ms >= lower_bound(p) - 1e-12


def test_bounded_with_per_block_recompute_matches_brute_force():
    """Tight memory, recompute allowed, random blocks: the DP prices a stage's selective option
    pair by pair; brute force scores every split with :func:`evaluate`. Both must agree, and
    the selective option must actually be chosen in some of the problems."""
    chosen = set()
    for seed in range(60):
        rng = random.Random(1000 + seed)
        n, k = rng.randrange(4, 10), rng.randrange(1, 4)
        base = random_problem(rng, n, k, memory=True)
        cap = sum(base.fixed_bytes) / k * 1.2 + max(base.inflight) * sum(base.activation_bytes) / k * 0.8
        p = dataclasses.replace(base, recompute=True, capacities=(cap,) * k,
                                block_cuts=tuple(sorted(rng.sample(range(1, n), rng.randrange(1, n)))))
        expected = brute_force(p)
        got = partition_bounded(p)
        if expected is None:
            assert got is None
            continue
        assert got is not None and got.fits
        assert got.bottleneck_ms == pytest.approx(expected, rel=1e-9)
        chosen |= set(got.recompute)
    assert Recompute.SELECTIVE in chosen and Recompute.NONE in chosen


def test_coarse_candidates_only_speed_it_up_and_positions_restrict_it():
    p = random_problem(random.Random(7), 40, 4, memory=False)
    full = partition_bounded(p)
    assert full is not None
    assert partition_bounded(p, coarse=p.allowed_cuts()[::5]).bottleneck_ms == pytest.approx(full.bottleneck_ms)
    only = p.allowed_cuts()[:3]
    restricted = partition_bounded(p, positions=only)
    assert restricted is not None and set(restricted.bounds[1:-1]) <= set(only)
    assert partition_bounded(p, positions=only[:2]) is None  # 3 cuts needed


def test_lower_bound_is_balance_or_the_largest_unit():
    p = Problem(compute_ms=(1.0, 9.0), forward_ms=(0.0, 0.0), boundary_ms=(0, 0, 0), input_bytes=(0, 0, 0),
                fixed_bytes=(0, 0), activation_bytes=(0, 0), speeds=(1.0, 3.0), capacities=(None, None),
                inflight=(1, 1))
    assert lower_bound(p) == pytest.approx(max(10 / 4, 9 / 3))
