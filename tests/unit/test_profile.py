"""Profiling measures every node and leaves the model exactly as it was."""

from __future__ import annotations

import pytest
import torch

import pipecut
from examples import gpt, resnet
from pipecut.capture import capture
from pipecut.errors import InputError
from pipecut.plan import LeafKind, NodeOp
from pipecut.profile.nodes import profile


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state.update({f"{n}.grad": p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return state


def test_profile_leaves_weights_buffers_grads_and_rng_untouched() -> None:
    model, inputs, loss_fn, target = resnet.build(batch_size=4)
    model.fc.weight.grad = torch.full_like(model.fc.weight, 0.5)  # an existing gradient stays
    before = _snapshot(model)
    rng = torch.get_rng_state()
    cap = capture(model, inputs)
    rows = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target, repeats=2, warmup=1)
    after = _snapshot(model)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k  # BatchNorm running stats included
    assert model.conv1.weight.grad is None if hasattr(model, "conv1") else model.stem[0].weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)
    assert len(rows) == len(cap.gm.graph.nodes)


def test_rows_describe_every_node() -> None:
    model, inputs, loss_fn, target = gpt.build(batch_size=2)
    cap = capture(model, inputs)
    rows = profile(cap, cap.flatten_inputs(inputs), loss_fn=loss_fn, target=target, repeats=2, warmup=1)
    by_name = {r.name: r for r in rows}
    compute = [r for r in rows if r.op in (NodeOp.CALL_MODULE, NodeOp.CALL_FUNCTION, NodeOp.CALL_METHOD)]
    assert all(r.forward_ms > 0 for r in compute)
    assert sum(r.backward_ms for r in compute) > 0
    head = next(r for r in rows if r.target == "lm_head")
    assert head.shape == (2, 64, 512) and head.dtype == "float32"
    assert head.output_bytes == 2 * 64 * 512 * 4
    assert head.parameters == ("tok_emb.weight",)  # the tied weight under its canonical name
    assert head.leaves[0].requires_grad
    size = next(r for r in rows if r.op is NodeOp.CALL_METHOD and r.target == "size")
    assert size.leaves[0].kind is LeafKind.CONSTANT and size.leaves[0].value == {"t": "int", "v": 64}  # idx.size(1)
    out = by_name["output"]
    assert out.forward_ms > 0  # the loss is timed on the output node


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    model, inputs, _, target = resnet.build(batch_size=4)

    def per_sample(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y, reduction="none")

    with pytest.raises(InputError, match=r"scalar tensor, got a tensor of shape \(2,\); reduce it"):
        pipecut.plan(model, inputs, 2, loss_fn=per_sample, target=target, microbatches=2, repeats=1, warmup=0)
