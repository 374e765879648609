"""The split pass: stage programs chained in one process compute the model exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

import pipecut
from examples import EXAMPLES
from pipecut.capture import capture
from pipecut.core.graph import canonical_names
from pipecut.core.kinds import Recompute
from pipecut.core.segment import Segment
from pipecut.passes.rewrite.split import split, split_stage, verify
from tests.reference import COUNTED


def _run_chained(programs: Any, cap: Any, inputs: Any) -> Any:
    flat = dict(zip(cap.input_names, cap.flatten_inputs(inputs)))
    received: tuple[Any, ...] = ()
    for prog in programs:
        out = prog.module(*received, *(flat[n] for n in prog.model_inputs))
        received = out if not prog.is_last else ()
    return cap.unflatten_output(out)


def _assert_chained_is_the_model(programs: Any, cap: Any, model: Any, inputs: Any, loss_fn: Any, target: Any) -> None:
    """The stage programs run one after another give the model's loss and gradients bitwise
    (the same ops in the same order)."""
    loss = loss_fn(_run_chained(programs, cap, inputs), target)
    loss.backward()
    names = canonical_names(model)
    got = {names[id(p)]: p.grad.clone() for p in model.parameters()}
    model.zero_grad()
    ref = loss_fn(model(*inputs), target)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=0, atol=0)
    for p in model.parameters():
        torch.testing.assert_close(got[names[id(p)]], p.grad, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
@pytest.mark.parametrize("k", [2, 3, 5])
def test_chained_stages_equal_the_model(name: str, k: int) -> None:
    model, inputs, loss_fn, target = EXAMPLES[name](batch_size=4)
    model.eval()  # BatchNorm in eval mode: both runs see the same statistics
    plan = pipecut.plan(
        model, inputs, k, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=COUNTED,
    )
    cap = capture(model, inputs)
    programs = split(cap.gm, plan)
    verify(cap.gm, programs, plan)
    nodes_before = [(n.name, n.op, n.target) for n in cap.gm.graph.nodes]

    _assert_chained_is_the_model(programs, cap, model, inputs, loss_fn, target)
    assert [(n.name, n.op, n.target) for n in cap.gm.graph.nodes] == nodes_before  # input untouched


def test_tied_embedding_lives_on_both_ends() -> None:
    model, inputs, loss_fn, target = EXAMPLES["gpt"](batch_size=2)
    plan = pipecut.plan(
        model, inputs, 3, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=COUNTED,
    )
    assert [(t.fqn, t.stages) for t in plan.tied] == [("tok_emb.weight", (0, 2))]
    programs = split(capture(model, inputs).gm, plan)
    assert programs[0].module.get_parameter("tok_emb.weight") is model.tok_emb.weight
    assert programs[2].module.get_parameter("lm_head.weight") is model.tok_emb.weight


def test_skip_connections_are_relayed() -> None:
    model, inputs, loss_fn, target = EXAMPLES["resnet"](batch_size=2)
    plan = pipecut.plan(
        model, inputs, 4, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=COUNTED,
    )
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert a.outputs == b.inputs and a.outputs  # every cut carries the values live across it


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_stages_recomputing_some_nodes_equal_the_model(name: str) -> None:
    """``Recompute.SELECTIVE``: the middle third of each stage runs in checkpointed segments;
    verify still finds every node once, and the result is bitwise the model's."""
    model, inputs, loss_fn, target = EXAMPLES[name](batch_size=4)
    model.eval()
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=COUNTED,
    )
    stages = tuple(dataclasses.replace(s, recompute=Recompute.SELECTIVE,
                                       recomputed=s.nodes[len(s.nodes) // 3: 2 * len(s.nodes) // 3])
                   for s in plan.stages)
    plan = dataclasses.replace(plan, stages=stages)
    cap = capture(model, inputs)
    programs = split(cap.gm, plan)
    verify(cap.gm, programs, plan)
    assert all(any(isinstance(m, Segment) for m in p.module.modules()) for p in programs)
    _assert_chained_is_the_model(programs, cap, model, inputs, loss_fn, target)


def test_verify_catches_a_lost_or_duplicated_node() -> None:
    model, inputs, loss_fn, target = EXAMPLES["gpt"](batch_size=2)
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=COUNTED,
    )
    gm = capture(model, inputs).gm
    programs = split(gm, plan)
    moved = plan.stages[1].nodes[0]
    first = dataclasses.replace(plan.stages[0], nodes=(*plan.stages[0].nodes, moved))
    doubled = dataclasses.replace(plan, stages=(first, *plan.stages[1:]))
    with pytest.raises(AssertionError, match=rf"node {moved} runs on stages 0 and 1"):
        verify(gm, (split_stage(gm, doubled, 0), programs[1]), plan)
    with pytest.raises(AssertionError, match="on no stage"):
        verify(gm, programs[:1], plan)
