"""pipecut.core.segment: a segment reads its stage's tensors by name, when it runs."""

from __future__ import annotations

import copy

import torch
import torch.fx as fx

from pipecut.core.segment import Segment


class _Stage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _segment_of(stage: torch.nn.Module) -> tuple[fx.GraphModule, Segment]:
    gm = fx.symbolic_trace(stage)
    graph = fx.Graph()
    x = graph.placeholder("x")
    lin = graph.call_module("lin", (x,))
    scale = graph.get_attr("scale")
    graph.output((graph.call_function(torch.mul, (lin, scale)),))
    return gm, Segment(gm, graph, ("lin", "mul"))


def test_a_segment_holds_no_tensors_and_reads_the_stage_when_it_runs() -> None:
    gm, seg = _segment_of(_Stage())
    gm.add_submodule("recompute_0", seg)
    assert list(seg.named_parameters()) == [] and list(seg.named_buffers()) == []
    assert [n for n, _ in gm.named_parameters()] == ["lin.weight", "lin.bias"]  # not twice
    x = torch.randn(2, 3)
    torch.testing.assert_close(seg(x)[0], gm(x))
    gm.lin.weight = torch.nn.Parameter(torch.zeros(3, 3))  # replaced after the segment was built
    gm.scale = torch.ones(3)
    torch.testing.assert_close(seg(x)[0], gm.lin.bias.expand(2, 3))


def test_a_deep_copy_of_the_stage_points_its_segment_at_the_copy() -> None:
    gm, seg = _segment_of(_Stage())
    gm.add_submodule("recompute_0", seg)
    twin = copy.deepcopy(gm)
    with torch.no_grad():
        twin.lin.weight.zero_()
    x = torch.randn(2, 3)
    torch.testing.assert_close(twin.recompute_0(x)[0], twin.lin.bias.expand(2, 3) * 2)
    torch.testing.assert_close(gm.recompute_0(x)[0], gm(x))  # the original still reads its own


def test_backward_through_a_segment_recomputes_and_matches() -> None:
    gm, seg = _segment_of(_Stage())
    x = torch.randn(4, 3, requires_grad=True)
    seg(x)[0].sum().backward()
    want = torch.autograd.grad(gm(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, want)
