"""pipecut.passes.costs.workload: the hybrid planner's view of a cost table, and all-reduce time."""

from __future__ import annotations

import numpy as np
import pytest

from pipecut.cluster import Link
from pipecut.core.kinds import NodeOp
from pipecut.passes.costs.stages import ring_allreduce_ms
from pipecut.passes.costs.workload import Workload, workload
from tests.unit.tiny import mlp_plan


def test_workload_of_a_plan_has_one_entry_per_unit():
    plan = mlp_plan()
    w = workload(plan.nodes)
    by_name = {n.name: n for n in plan.nodes}
    assert w.units == len(w.names) > 0
    assert all(by_name[u].op not in (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR) for u in w.names)
    assert w.forward_ms == tuple(by_name[u].forward_ms for u in w.names)
    assert sum(w.param_bytes) == sum(n.param_bytes for n in plan.nodes)
    assert len(w.cut_forward_bytes) == len(w.crossable) == w.units + 1
    assert w.compute_ms == pytest.approx(sum(n.forward_ms + n.backward_ms for n in by_name.values()
                                             if n.name in set(w.names)))


def test_workload_checks_its_arrays():
    with pytest.raises(ValueError, match="a workload of 2 units needs 2 param_bytes, got 1"):
        Workload(forward_ms=(1.0, 1.0), backward_ms=(1.0, 1.0), param_bytes=(1,))
    with pytest.raises(ValueError, match="needs 3 crossable, got 2"):
        Workload(forward_ms=(1.0, 1.0), backward_ms=(1.0, 1.0), param_bytes=(1, 1), crossable=(True, True))
    with pytest.raises(ValueError, match="at least one unit"):
        Workload(forward_ms=(), backward_ms=(), param_bytes=())


def test_ring_allreduce_cost():
    link = Link(bandwidth_bytes_per_ms=100.0, latency_ms=0.5)
    # 4 replicas: 6 steps of a quarter of the buffer each.
    assert ring_allreduce_ms(400.0, 4, link) == pytest.approx(6 * 0.5 + 6 / 4 * 4.0)
    assert ring_allreduce_ms(400.0, 1, link) == 0.0  # nothing to reduce with
    assert ring_allreduce_ms(0.0, 4, link) == 0.0
    got = ring_allreduce_ms(np.array([0.0, 400.0]), 4, link)
    assert got.tolist() == pytest.approx([0.0, 9.0])
