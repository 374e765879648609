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


def test_a_replica_row_is_priced_as_its_twin_over_the_replicas() -> None:
    """The replica's graph is counted, not priced: each row takes its twin's times and
    activation bytes over D (the run model's share), its parameter bytes as they are (one
    GPU's of a tensor group), and its own names and shapes; a shape node the whole batch's
    graph lacks costs nothing."""
    from pipecut.core.kinds import NodeOp
    from pipecut.ir import CostSource, NodeCost
    from pipecut.planning.cluster.run_plan import replica_rows

    def row(name: str, target: str, **kw: object) -> NodeCost:
        return NodeCost(name=name, op=NodeOp.CALL_FUNCTION, target=target, module="layers.0", **kw)  # type: ignore[arg-type]

    priced = (row("mm", "aten.mm", forward_ms=4.0, backward_ms=8.0, output_bytes=1000, saved_bytes=999,
                  param_bytes=512, shape=(8, 16), rebuilt=True),
              row("relu", "aten.relu", forward_ms=1.0, backward_ms=1.0, output_bytes=1000, shape=(8, 16)))
    counted = (row("mm_1", "aten.mm", output_bytes=250, param_bytes=1024, shape=(2, 32)),
               row("sym_size", "aten.sym_size", forward_ms=0.5),
               row("relu_1", "aten.relu", output_bytes=250, shape=(2, 32)))
    mm, size, relu = replica_rows(counted, priced, 4)
    assert (mm.name, mm.shape, mm.forward_ms, mm.backward_ms) == ("mm_1", (2, 32), 1.0, 2.0)
    assert (mm.output_bytes, mm.saved_bytes, mm.param_bytes, mm.rebuilt) == (250, 250, 512, True)
    assert (size.forward_ms, size.backward_ms, size.source) == (0.0, 0.0, CostSource.ESTIMATED)
    assert (relu.name, relu.forward_ms, relu.output_bytes, relu.rebuilt) == ("relu_1", 0.25, 250, False)
