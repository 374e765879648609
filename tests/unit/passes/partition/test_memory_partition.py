"""pipecut.passes.partition.memory_partition: the memory-aware partitioner (bounded DP + ILP) end to end."""

from __future__ import annotations

import math

import pytest

from pipecut.errors import PartitionError
from pipecut.passes.partition.memory_dp import partition_bounded
from pipecut.passes.partition.memory_partition import partition_ilp
from pipecut.passes.partition.problem import Problem


def problem(n=8, k=2, *, caps=None, recompute=False, boundary=None) -> Problem:
    return Problem(
        compute_ms=tuple(1.0 + (i % 3) for i in range(n)), forward_ms=(0.5,) * n,
        boundary_ms=boundary or (0.0,) + (0.1,) * (n - 1) + (0.0,),
        input_bytes=(0,) + (10,) * (n - 1) + (0,), fixed_bytes=(100,) * n,
        activation_bytes=(20,) * n, speeds=(1.0,) * k, capacities=caps or (None,) * k,
        inflight=tuple(range(k, 0, -1)), recompute=recompute,
    )


def test_the_ilp_confirms_the_exact_split():
    p = problem(caps=(600, 600), recompute=True)
    result = partition_ilp(p, time_limit_s=600)  # asserts a proved optimum: no wall-clock race
    exact = partition_bounded(p)
    assert result.evaluation.fits
    assert result.evaluation.bottleneck_ms == pytest.approx(exact.bottleneck_ms)
    assert result.optimal and "agrees with the DP" in result.detail
    assert partition_ilp(problem(k=1)).detail == "one stage"


def test_too_many_stages_for_the_crossable_cuts():
    boundary = (0.0, 0.1, math.inf, math.inf, 0.0)
    with pytest.raises(PartitionError, match="only 1 places where every live value can cross a cut; use at most 2 devices"):
        partition_ilp(problem(n=4, k=3, boundary=boundary))


def test_nothing_fits_names_the_memory_that_would():
    with pytest.raises(PartitionError, match=r"no split of 8 nodes into 2 stages fits .* 2 devices would need"):
        partition_ilp(problem(caps=(150, 150)))
