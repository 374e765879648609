"""pipecut.capture.frozen: a ``no_grad`` block in ``forward`` stays frozen in the traced graph."""

from __future__ import annotations

import torch
from torch import fx, nn

from pipecut.capture import capture
from pipecut.capture.frozen import (
    GRAD_ENABLED,
    detach_tree,
    honour_no_grad,
    inside_no_grad,
    no_grad_nodes,
)


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        with torch.no_grad():
            y = self.frozen(x).relu()
        return self.head(y * x)


def marked_graph() -> fx.Graph:
    gm = fx.symbolic_trace(Frozen())  # plain fx: no grad modes recorded, so mark by hand
    for n in gm.graph.nodes:
        n.meta[GRAD_ENABLED] = n.name not in ("frozen", "relu")
    return gm


def test_detach_tree_detaches_every_tensor_and_keeps_the_rest():
    a = torch.ones(2, requires_grad=True)
    out = detach_tree({"a": a, "n": 3, "t": (a * 2,)})
    assert not out["a"].requires_grad and not out["t"][0].requires_grad and out["n"] == 3
    assert out["a"].data_ptr() == a.data_ptr()  # an alias, not a copy


def test_a_graph_without_no_grad_is_returned_as_it_is():
    gm = fx.symbolic_trace(Frozen())
    for n in gm.graph.nodes:
        n.meta[GRAD_ENABLED] = True
    assert no_grad_nodes(gm.graph) == []
    assert honour_no_grad(gm.graph) is gm.graph


def test_frozen_nodes_read_detached_inputs_and_their_values_are_detached():
    gm = marked_graph()
    before = [n.format_node() for n in gm.graph.nodes]
    assert [n.name for n in no_grad_nodes(gm.graph)] == ["frozen", "relu"]
    graph = honour_no_grad(gm.graph)
    assert [n.format_node() for n in gm.graph.nodes] == before  # the input graph is untouched
    by_name = {n.name: n for n in graph.nodes}
    assert by_name["frozen"].args[0].target is detach_tree  # x enters detached
    relu_users = list(by_name["relu"].users)
    assert [u.target for u in relu_users] == [detach_tree]  # and leaves detached
    assert inside_no_grad(by_name["relu"]) and not inside_no_grad(relu_users[0])
    assert not inside_no_grad(by_name["head"])


def test_captured_gradients_match_the_eager_model():
    torch.manual_seed(0)
    model = Frozen()
    x = torch.randn(3, 4, requires_grad=True)
    captured = capture(model, (x,))
    out = captured.gm(*captured.flatten_inputs((x,)))
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.sum().backward()
    got = {n: p.grad.clone() if p.grad is not None else None for n, p in model.named_parameters()}
    got_x = x.grad.clone()
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).sum().backward()
    assert got["frozen.weight"] is None and model.frozen.weight.grad is None
    assert torch.allclose(got["head.weight"], model.head.weight.grad)
    assert torch.allclose(got_x, x.grad)
