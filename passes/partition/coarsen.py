"""Coarsening: choose a few hundred candidate cut positions out of thousands.

The ILP has one binary per (cut, position), so a 10,000-node graph must be cut only at a
subset of positions. Three reductions, in order of how much they can cost:

1. *Lossless*: a position where some live value cannot cross (``boundary_ms`` is inf) is never
   a candidate; runs of units between two crossable positions behave as one block.
2. *Module boundaries*: positions where the module path changes at some depth (between
   transformer layers, between attention and MLP, ...) are where a person would cut and where
   few values are live. The deepest depth that yields at most ``max_positions`` is used.
3. *Chains*: a block heavier than ``total / max_positions`` (a flat graph without modules) is
   split at equal compute intervals, at the cheapest cut in each interval.

The exact bounded DP (:mod:`pipecut.passes.partition.memory_dp`) still sees every position; its cuts are
added to the candidates so that the ILP over the candidates can only confirm or improve on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["block_cuts", "candidate_cuts", "chain_cuts", "module_cuts"]


def _prefix_at_depth(module: str, depth: int) -> str:
    return ".".join(module.split(".")[:depth]) if module else ""


def module_cuts(modules: Sequence[str], allowed: Sequence[int], depth: int) -> list[int]:
    """Allowed positions b where unit b-1 and unit b belong to different modules at ``depth``."""
    return [
        b
        for b in allowed
        if _prefix_at_depth(modules[b - 1], depth) != _prefix_at_depth(modules[b], depth)
    ]


def block_cuts(modules: Sequence[str], allowed: Sequence[int], max_blocks: int = 64) -> tuple[int, ...]:
    """The blocks a stage may recompute one by one: the module boundaries of the deepest depth
    that gives at most ``max_blocks`` of them (transformer layers, or their attention and MLP)."""
    chosen: list[int] = []
    deepest = max((m.count(".") + 1 for m in modules if m), default=0)
    for depth in range(1, deepest + 1):
        cuts = module_cuts(modules, allowed, depth)
        if len(cuts) > max_blocks:
            break
        chosen = cuts
    return tuple(chosen)


def chain_cuts(
    compute_ms: Sequence[float], boundary_ms: Sequence[float], allowed: Sequence[int], blocks: int
) -> list[int]:
    """About ``blocks`` positions at equal compute intervals, each the cheapest cut in its interval."""
    if not allowed or blocks < 1:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(compute_ms, dtype=np.float64))])
    total = prefix[-1] if prefix[-1] > 0 else 1.0
    bins: dict[int, int] = {}
    for b in allowed:
        key = min(int(prefix[b] / total * blocks), blocks - 1)
        if key not in bins or boundary_ms[b] < boundary_ms[bins[key]]:
            bins[key] = b
    return sorted(bins.values())


def candidate_cuts(
    modules: Sequence[str],
    compute_ms: Sequence[float],
    boundary_ms: Sequence[float],
    *,
    max_positions: int = 240,
) -> tuple[int, ...]:
    """At most about ``max_positions`` cut positions that keep the good cuts of the graph."""
    n = len(compute_ms)
    allowed = [b for b in range(1, n) if math.isfinite(boundary_ms[b])]
    if len(allowed) <= max_positions:
        return tuple(allowed)
    chosen: list[int] = []
    depth = 1
    deepest = max((m.count(".") + 1 for m in modules if m), default=0)
    while depth <= deepest:
        cuts = module_cuts(modules, allowed, depth)
        if len(cuts) > max_positions:
            break
        chosen = cuts
        depth += 1
    if len(chosen) < max_positions // 2:
        # Too few module boundaries: add chain cuts so no block is much heavier than average.
        extra = chain_cuts(compute_ms, boundary_ms, allowed, max_positions - len(chosen))
        chosen = sorted(set(chosen) | set(extra))
    return tuple(chosen)
