"""Cuts carry only what must cross: a parameter-free function of the inputs (a causal mask,
rotary tables) is computed again on the stage that reads it when that costs less than sending it."""

from __future__ import annotations

import pytest
import torch

import pipecut
from examples import zoo
from pipecut.capture import capture
from pipecut.cluster import Link
from pipecut.core.graph import canonical_names
from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import Leaf, NodeCost
from pipecut.options import UNBOUNDED
from pipecut.passes.partition.chain import liveness
from pipecut.passes.partition.rebuild import mark_rebuilt, rebuildable
from pipecut.passes.rewrite.split import split, verify
from tests.unit.passes.rewrite.test_split import _run_chained

SLOW = Link(bandwidth_bytes_per_ms=1e6, latency_ms=1.0)
INSTANT = Link(bandwidth_bytes_per_ms=1e15, latency_ms=0.0)


def _row(name: str, op: NodeOp, target: str, inputs: tuple[str, ...] = (), *, grad: bool = False,
         params: tuple[str, ...] = (), nbytes: int = 4096, ms: float = 0.01) -> NodeCost:
    leaf = Leaf(kind=LeafKind.TENSOR, shape=(nbytes // 4,), dtype="float32", requires_grad=grad)
    return NodeCost(name=name, op=op, target=target, inputs=inputs, forward_ms=ms, leaves=(leaf,),
                    parameters=params, param_bytes=64 if params else 0, output_bytes=nbytes,
                    treespec='[1, {"type": null, "context": null, "children_spec": []}]')


F, M, P, G = NodeOp.CALL_FUNCTION, NodeOp.CALL_METHOD, NodeOp.PLACEHOLDER, NodeOp.GET_ATTR


def _table() -> tuple[NodeCost, ...]:
    """ids -> emb(W) -> h1 -> h2 -> out, with a mask built from ids and a buffer that h1 and
    h2 read, a random mask, and a value another op writes in place."""
    return (
        _row("ids", P, "ids"),
        _row("inv_freq", G, "rope.inv_freq"),
        _row("w", G, "emb.weight", params=("emb.weight",)),
        _row("arange", F, "torch.arange", ("ids",)),
        _row("mask", F, "torch.triu", ("arange", "inv_freq")),
        _row("drop", F, "torch.nn.functional.dropout", ("arange",)),
        _row("written", F, "torch.zeros_like", ("ids",)),
        _row("fill", M, "masked_fill_", ("written", "mask")),
        _row("emb", F, "torch.nn.functional.embedding", ("ids", "w"), grad=True),
        _row("h1", F, "operator.add", ("emb", "mask", "drop", "fill"), grad=True),
        _row("h2", F, "operator.mul", ("h1", "mask"), grad=True),
    )


def test_only_parameter_free_deterministic_unwritten_values_of_the_inputs_are_rebuildable() -> None:
    assert rebuildable(_table()) == {"arange", "mask"}


def test_a_value_is_rebuilt_only_where_that_beats_sending_it_and_then_crosses_no_cut() -> None:
    table = _table()
    slow = mark_rebuilt(table, SLOW)
    assert {n.name for n in slow if n.rebuilt} == {"arange", "mask"}
    assert all(not n.rebuilt for n in mark_rebuilt(table, INSTANT))  # sending is free: send
    assert all(not n.rebuilt for n in table)  # the input table is not changed
    assert mark_rebuilt(slow, INSTANT) == table  # decided afresh, not carried over
    crossing = liveness(slow).crossing(liveness(slow).index["h1"])
    assert "mask" not in crossing and "arange" not in crossing
    assert "mask" in liveness(table).crossing(liveness(table).index["h1"])


@pytest.mark.parametrize("starts", [["model.layers.2"], ["model.layers.1", "model.layers.3"]])
def test_a_llama_sends_only_the_hidden_state_and_its_stages_chained_are_the_model(starts: list[str]) -> None:
    """The transformers Llama's causal mask and rotary tables are rebuilt on every stage: each
    cut carries one tensor, and the stages run one after another give the model's loss and
    gradients bitwise."""
    torch.manual_seed(0)
    model, inputs, loss_fn, target = zoo.llama(batch_size=4, layers=4)
    # Both captures unbounded: under load torch.export's 30 s bound ran out in one of them only,
    # and the static-shape graph it fell back to lacks the plan's symbolic-size nodes.
    plan = pipecut.plan(model, inputs, len(starts) + 1, loss_fn=loss_fn, target=target, microbatches=1,
                        schedule="gpipe", measure=pipecut.MeasureOptions(estimate="A100-80GB"),
                        partition=pipecut.PartitionOptions(split=starts),
                        capture=pipecut.CaptureOptions(time_limit=UNBOUNDED))
    assert any(n.rebuilt for n in plan.nodes)
    for stage in plan.stages[1:]:
        tensors = [leaf for name in stage.inputs for leaf in plan.node(name).leaves if leaf.kind is LeafKind.TENSOR]
        assert len(tensors) == 1, (stage.index, stage.inputs)
    assert all(not plan.node(e.src_node).rebuilt for e in plan.edges)
    assert pipecut.Plan.from_json(plan.to_json()) == plan  # the choice is recorded in the plan
    cap = capture(model, inputs, time_limit=UNBOUNDED)
    programs = split(cap.gm, plan)
    verify(cap.gm, programs, plan)
    assert any(n.name in {r.name for r in plan.nodes if r.rebuilt}
               for prog in programs[1:] for n in prog.module.graph.nodes)  # stage 1.. rebuild
    loss = loss_fn(_run_chained(programs, cap, inputs), target)
    loss.backward()
    names = canonical_names(model)
    got = {names[id(p)]: p.grad.clone() for p in model.parameters()}
    model.zero_grad()
    ref = loss_fn(model(**inputs), target)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)  # the same ops in the same order
    for p in model.parameters():
        torch.testing.assert_close(got[names[id(p)]], p.grad, rtol=0, atol=0)


def test_a_cluster_plan_across_nodes_sends_the_hidden_state_and_not_the_mask() -> None:
    """Issue 29's case, shrunk: a Llama-3.1-8B's shapes with 4 layers on 2 nodes, 2 stages with
    the replicas inside nodes (each cut crosses the network). The 8k-token causal mask (64 MiB
    of bool) and the rotary tables are rebuilt on stage 1: only activations (values a gradient
    flows back through) cross."""
    from examples import llama_meta
    from pipecut.planning.cluster.plan import plan_cluster

    model, inputs, loss_fn, target = llama_meta.build(batch_size=4, num_hidden_layers=4)
    plan = plan_cluster(model, inputs, "2x2xH100-SXM",
                        data_parallel=pipecut.DataParallelOptions(replicas=2), microbatches=2, loss_fn=loss_fn,
                        target=target, tensor_parallel=1)  # the pipeline's cut, not a tensor group
    assert plan.num_stages == 2
    crossing = [leaf for name in plan.stages[1].inputs for leaf in plan.node(name).leaves
                if leaf.kind is LeafKind.TENSOR]
    assert crossing and all(leaf.requires_grad for leaf in crossing), plan.stages[1].inputs
    assert any(n.rebuilt and n.shape == (1, 1, 8192, 8192) for n in plan.nodes)
