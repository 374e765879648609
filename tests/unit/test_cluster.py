"""Cluster data: GPUs to nodes, the link between two GPUs, placements of D × K."""

from __future__ import annotations

import pytest

from pipecut.cluster import Cluster, ClusterPlacement, Layout, Link
from pipecut.errors import InputError

NV = Link(name="nvlink", bandwidth_bytes_per_ms=4e8, latency_ms=0.01)
IB = Link(name="ib", bandwidth_bytes_per_ms=5e7, latency_ms=0.02)


def test_links_between_gpus_of_one_node_and_of_two() -> None:
    c = Cluster(nodes=2, gpus_per_node=4, device="X", memory_bytes=1, peak_flops=1.0, intra=NV, inter=IB)
    assert c.gpus == 8 and c.spec == "2x4xX"
    assert [c.node_of(g) for g in range(8)] == [0] * 4 + [1] * 4
    assert c.link_between(2, 3) is NV and c.link_between(3, 4) is IB
    assert c.ring_link((0, 1, 2, 3)) is NV and c.ring_link((0, 4)) is IB


@pytest.mark.parametrize(("layout", "grid"), [
    (Layout.STAGES_INSIDE_NODES, ((0, 0), (0, 1), (1, 0), (1, 1))),
    (Layout.REPLICAS_INSIDE_NODES, ((0, 0), (1, 0), (0, 1), (1, 1))),
])
def test_placement_grid(layout: Layout, grid: tuple) -> None:
    p = ClusterPlacement(layout=layout, replicas=2, stages=2)
    assert p.grid() == grid
    assert sorted(p.replica_group(1)) == sorted(g for g, (_, s) in enumerate(grid) if s == 1)


def test_bad_cluster_data_is_refused() -> None:
    with pytest.raises(InputError, match="at least 1 node"):
        Cluster(nodes=0, gpus_per_node=4, device="X", memory_bytes=1, peak_flops=1.0, intra=NV, inter=IB)
    with pytest.raises(InputError, match="bandwidth must be positive"):
        Link(name="x", bandwidth_bytes_per_ms=0, latency_ms=0)
    with pytest.raises(InputError, match="replicas and stages ≥ 1"):
        ClusterPlacement(layout=Layout.STAGES_INSIDE_NODES, replicas=0, stages=1)


def test_a_prediction_names_its_largest_part_and_its_range() -> None:
    from pipecut.cluster import RunPrediction, StepPart

    parts = (StepPart(name="compute", ms=4.0), StepPart(name="link ib", ms=5.0), StepPart(name="bubble", ms=1.0))
    r = RunPrediction(step_ms=10.0, bubble_fraction=0.1, tokens_per_s_per_gpu=1.0, mfu=0.1,
                      peak_memory_bytes=1, parts=parts, step_low_ms=9.0, step_high_ms=12.0)
    assert r.dominant == "link ib" and r.has_range
    assert RunPrediction(step_ms=10.0, bubble_fraction=0.1, tokens_per_s_per_gpu=1.0, mfu=0.1,
                         peak_memory_bytes=1).dominant == ""
