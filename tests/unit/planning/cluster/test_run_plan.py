"""The plan of a chosen cluster run: one replica's stages, cut where the run is cut."""

from __future__ import annotations

from pipecut.options import DataParallelOptions
from pipecut.passes.partition.chain import liveness
from pipecut.planning.cluster.plan import plan_cluster
from tests.unit.tiny import tiny_llama


def test_cuts_map_onto_a_replica_captured_at_one_sample() -> None:
    """Two replicas of a batch of 8 in 4 microbatches run one sample per microbatch: the
    replica's capture folds away a batch-1 graph's slices and expands and numbers its nodes
    anew, so the whole batch's cuts are mapped by op, not by name (they once mapped out of
    order, and the plan was refused)."""
    model, batch = tiny_llama()
    plan = plan_cluster(model, batch, "4x8xH100-SXM", microbatches=4, tensor_parallel=1,
                        data_parallel=DataParallelOptions(replicas=2))
    assert plan.placement is not None and plan.placement.replicas == 2
    assert plan.batch_size == 4 and plan.num_stages == plan.placement.stages > 2
    units = liveness(plan.nodes).units
    firsts = [units.index(next(n for n in s.nodes if n in units)) for s in plan.stages]
    assert firsts == sorted(firsts) and len(set(firsts)) == len(firsts)
    names = [n.name for n in plan.nodes]
    assert [n for s in plan.stages for n in s.nodes if n in units] == [u for u in units if u in names]
    assert all(s.forward_ms > 0 for s in plan.stages)
