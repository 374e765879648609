"""pipecut.passes.rewrite.segments: runs of a stage's nodes recomputed through checkpointed segments."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

from examples import gpt
from pipecut.core.graph import module_path
from pipecut.core.segment import Segment
from pipecut.errors import PlanError
from pipecut.passes.rewrite.segments import checkpoint_segments, segment_runs


def _saved_bytes(fn) -> tuple[int, torch.Tensor]:
    """Bytes autograd keeps for backward while ``fn`` runs (what recompute is to save)."""
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total, out


def _gpt_graph() -> tuple[fx.GraphModule, tuple, object, torch.Tensor]:
    from pipecut.capture import capture

    model, inputs, loss_fn, target = gpt.build()
    return capture(model, inputs).gm, inputs, loss_fn, target


def test_segments_give_the_same_gradients_keep_less_and_leave_the_input_alone() -> None:
    gm, inputs, loss_fn, target = _gpt_graph()
    before = [n.format_node() for n in gm.graph.nodes]
    block = {n.name for n in gm.graph.nodes if n.op.startswith("call_") and module_path(n).startswith("blocks.1.")}
    assert len(block) > 5
    seg = checkpoint_segments(gm, block)
    assert [n.format_node() for n in gm.graph.nodes] == before  # a copy; the input is not edited
    assert sum(isinstance(m, Segment) for m in seg.modules()) >= 1
    assert [n for n, _ in seg.named_parameters()] == [n for n, _ in gm.named_parameters()]
    assert list(seg.state_dict()) == list(gm.state_dict())

    results = []
    for module in (gm, seg):
        torch.manual_seed(0)
        kept, out = _saved_bytes(lambda m=module: m(*inputs))
        loss = loss_fn(out, target)
        loss.backward()
        results.append((kept, loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters()}))
        module.zero_grad(set_to_none=True)
    (kept_plain, loss_plain, grads_plain), (kept_seg, loss_seg, grads_seg) = results
    assert kept_seg < kept_plain  # the block's activations are not kept
    torch.testing.assert_close(loss_seg, loss_plain, rtol=0, atol=0)
    for name, g in grads_plain.items():  # the same kernels on the same values: bitwise equal
        torch.testing.assert_close(grads_seg[name], g, rtol=0, atol=0, msg=name)


def test_a_node_writing_into_a_value_from_outside_its_run_is_not_recomputed() -> None:
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.sin, (x,))
    w = g.call_function(torch.Tensor.add_, (a, 1.0))  # writes into a: inside the run, fine
    b = g.call_function(torch.cos, (w,))
    outside = g.call_function(torch.relu_, (x,))  # writes into the input x: stays outside
    c = g.call_function(operator.mul, (b, outside))
    g.output(c)
    gm = fx.GraphModule(torch.nn.Module(), g)
    names = {"sin", "add_", "cos", "relu_", "mul"}
    runs = segment_runs(gm, names)
    assert [[n.name for n in r] for r in runs] == [["sin", "add_", "cos"], ["mul"]]
    x0 = torch.randn(3)
    seg = checkpoint_segments(gm, names)
    torch.testing.assert_close(seg(x0.clone()), gm(x0.clone()))


def test_unknown_nodes_are_refused_naming_the_stage() -> None:
    gm, *_ = _gpt_graph()
    with pytest.raises(PlanError, match=r"stage 3 recomputes node.*no_such_node.*re-plan"):
        checkpoint_segments(gm, {"no_such_node"}, where="stage 3")


def test_a_recomputed_dropout_draws_the_mask_its_forward_drew() -> None:
    """Recompute runs the segment again inside backward: with the RNG state of the first run,
    so the gradients are those of the mask the forward used (the plain model's)."""

    class Drop(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.dropout(self.lin(x).relu(), 0.5, True).sum(-1)

    gm = fx.symbolic_trace(Drop())
    seg = checkpoint_segments(gm, {n.name for n in gm.graph.nodes if n.op.startswith("call_")})
    assert any(isinstance(m, Segment) for m in seg.modules())
    x = torch.randn(8, 16)
    grads = []
    for module in (gm, seg):
        torch.manual_seed(3)
        module(x).sum().backward()
        grads.append(gm.lin.weight.grad.clone())
        gm.zero_grad(set_to_none=True)
        torch.rand(1)  # the RNG moves on between the two runs: only the seed above matters
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
