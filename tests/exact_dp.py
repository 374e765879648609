"""The reference partitioner for tests: the plain O(K·N²) dynamic program over a chain.

The package plans with :mod:`pipecut.passes.partition.memory_dp` (the same optimum over the full cost
model, pruned by a bound); tests check it, the ILP and the holder rule against this one.

Pure numbers, no torch. Stage ``s`` over units ``[i, j)`` costs

    cost_s(i, j) = sum(compute_ms[i:j]) / speed[s] + boundary_ms[i] + boundary_ms[j]

where ``boundary_ms[b]`` is the time to move the values live across the cut before unit ``b``
(activations forward, gradients backward). The dynamic program

    best[s][j] = min over i of max(best[s-1][i], cost_s(i, j))

is exact for this objective. It runs in O(K·N²) with the inner minimum vectorised in numpy.
Optional per-stage memory capacities make a (i, j) choice infeasible when the stage's memory
``fixed_bytes[i:j].sum() + inflight[s] * activation_bytes[i:j].sum()`` exceeds capacity.
With ``holds_params`` every stage must hold a unit that reads a parameter
(:mod:`pipecut.passes.partition.holders`): otherwise its rank would have nothing to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipecut.errors import PartitionError
from pipecut.passes.partition.holders import holder_prefix, stage_count_error

__all__ = ["Chain", "Partition", "partition_dp", "stage_cost"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Chain:
    """A partitioning problem over N units in a fixed order."""

    names: tuple[str, ...]
    compute_ms: tuple[float, ...]
    """Forward + backward time of each unit on a speed-1 device."""
    boundary_ms: tuple[float, ...]
    """N + 1 entries: communication time of a cut before unit b (0 and N are never cut: 0)."""
    fixed_bytes: tuple[int, ...] = ()
    """Per unit: parameter, gradient and optimizer-state bytes."""
    activation_bytes: tuple[int, ...] = ()
    """Per unit: activation bytes one microbatch keeps until its backward."""
    holds_params: tuple[bool, ...] = ()
    """Per unit: reads a parameter. When given, every stage holds at least one such unit."""

    def __post_init__(self) -> None:
        n = len(self.compute_ms)
        if len(self.names) != n or len(self.boundary_ms) != n + 1:
            raise ValueError(f"chain of {n} units needs {n} names and {n + 1} boundary times")
        for field in (self.fixed_bytes, self.activation_bytes, self.holds_params):
            if field and len(field) != n:
                raise ValueError(f"per-unit memory arrays need {n} entries, got {len(field)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    bounds: tuple[int, ...]
    """K + 1 increasing unit indices: stage s holds units [bounds[s], bounds[s+1])."""
    stage_ms: tuple[float, ...]

    @property
    def bottleneck_ms(self) -> float:
        return max(self.stage_ms)


def stage_cost(chain: Chain, i: int, j: int, speed: float = 1.0) -> float:
    return sum(chain.compute_ms[i:j]) / speed + chain.boundary_ms[i] + chain.boundary_ms[j]


def partition_dp(
    chain: Chain,
    stages: int,
    *,
    speeds: Sequence[float] | None = None,
    capacities: Sequence[float | None] | None = None,
    inflight: Sequence[int] | None = None,
) -> Partition:
    """Optimal contiguous split of ``chain`` into ``stages`` non-empty stages."""
    n = len(chain.compute_ms)
    if stages < 1:
        raise PartitionError(f"the number of stages must be at least 1, got {stages}")
    if stages > n:
        raise PartitionError(
            f"cannot cut a graph of {n} partitionable nodes into {stages} stages; "
            f"use at most {n} devices"
        )
    positions = [b for b in range(1, n) if np.isfinite(chain.boundary_ms[b])]
    too_many = stage_count_error(stages, chain.holds_params, positions)
    if too_many is not None:
        raise too_many
    speeds = list(speeds) if speeds is not None else [1.0] * stages
    capacities = list(capacities) if capacities is not None else [None] * stages
    inflight = list(inflight) if inflight is not None else [1] * stages
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(chain.compute_ms, dtype=np.float64))])
    boundary = np.asarray(chain.boundary_ms, dtype=np.float64)
    fixed = np.concatenate([[0.0], np.cumsum(np.asarray(chain.fixed_bytes or [0] * n, dtype=np.float64))])
    act = np.concatenate([[0.0], np.cumsum(np.asarray(chain.activation_bytes or [0] * n, dtype=np.float64))])
    holders = holder_prefix(chain.holds_params, n)

    inf = np.inf
    best = np.full((stages + 1, n + 1), inf)
    choice = np.zeros((stages + 1, n + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        # stage s-1 (0-based) ends at j; it starts at i with s-1 <= i < j.
        for j in range(s, n - (stages - s) + 1):
            i = np.arange(s - 1, j)
            cost = (prefix[j] - prefix[i]) / speeds[s - 1] + boundary[i] + boundary[j]
            cap = capacities[s - 1]
            if cap is not None:
                mem = (fixed[j] - fixed[i]) + inflight[s - 1] * (act[j] - act[i])
                cost = np.where(mem <= cap, cost, inf)
            cost = np.where(holders[j] - holders[i] >= 1, cost, inf)
            total = np.maximum(best[s - 1, i], cost)
            k = int(np.argmin(total))
            best[s, j] = total[k]
            choice[s, j] = i[k]
    if not np.isfinite(best[stages, n]):
        raise PartitionError(
            f"no split of {n} nodes into {stages} stages fits the memory capacities "
            f"{capacities}; give the devices more memory, use more devices, or enable recompute"
        )
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(int(choice[s, bounds[-1]]))
    bounds.reverse()
    stage_ms = tuple(
        stage_cost(chain, bounds[s], bounds[s + 1], speeds[s]) for s in range(stages)
    )
    return Partition(bounds=tuple(bounds), stage_ms=stage_ms)
