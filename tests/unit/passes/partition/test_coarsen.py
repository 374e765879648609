"""pipecut.passes.partition.coarsen: choosing candidate cut positions in large graphs."""

from __future__ import annotations

import math

from pipecut.passes.partition.coarsen import candidate_cuts, chain_cuts, module_cuts


def test_module_cuts_at_each_depth():
    modules = ["a.x", "a.x", "a.y", "b.x", "b.x", ""]
    allowed = [1, 2, 3, 4, 5]
    assert module_cuts(modules, allowed, 1) == [3, 5]
    assert module_cuts(modules, allowed, 2) == [2, 3, 5]
    assert module_cuts(modules, [1, 2, 4], 2) == [2]  # only allowed positions


def test_chain_cuts_pick_the_cheapest_cut_per_compute_interval():
    compute = [1.0] * 8
    boundary = [0, 5, 1, 5, 5, 2, 5, 5, 0]
    assert chain_cuts(compute, boundary, range(1, 8), 2) == [2, 5]
    assert chain_cuts(compute, boundary, [], 3) == []
    assert chain_cuts(compute, boundary, [1, 2], 0) == []


def test_candidates_keep_every_allowed_cut_when_few_and_never_an_uncrossable_one():
    boundary = [0.0, 1.0, math.inf, 1.0, 0.0]
    assert candidate_cuts(["", "", "", ""], [1.0] * 4, boundary) == (1, 3)


def test_many_positions_are_reduced_to_module_boundaries():
    layers, per = 50, 20
    modules = [f"layers.{i}.{'attn' if j < per // 2 else 'mlp'}" for i in range(layers) for j in range(per)]
    n = len(modules)
    boundary = [0.0] + [1.0] * (n - 1) + [0.0]
    cuts = candidate_cuts(modules, [1.0] * n, boundary, max_positions=120)
    assert 0 < len(cuts) <= 120
    assert set(range(per, n, per)) <= set(cuts)  # every layer boundary
    assert all(modules[b - 1] != modules[b] for b in cuts)


def test_a_flat_graph_gets_chain_cuts():
    n = 1000
    cuts = candidate_cuts([""] * n, [1.0] * n, [0.0] + [1.0] * (n - 1) + [0.0], max_positions=50)
    assert 40 <= len(cuts) <= 50
    gaps = [b - a for a, b in zip((0, *cuts), (*cuts, n))]
    assert max(gaps) <= 2 * n / 50
