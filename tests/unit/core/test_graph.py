"""pipecut.core.graph: small facts about fx nodes."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from pipecut.core.graph import (
    attr_tensor,
    canonical_names,
    module_path,
    mutates_first_arg,
    node_parameters,
    target_name,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
        self.out = nn.Linear(4, 2)
        self.w = nn.Parameter(torch.ones(2))

    def forward(self, x):
        y = self.block(x)
        y += 1
        y = torch.relu(y)
        y = y.add_(1)
        return self.out(y) * self.w


def nodes(gm):
    return {n.name: n for n in gm.graph.nodes}


def test_target_names_are_qualified_and_readable():
    gm = fx.symbolic_trace(Net())
    n = nodes(gm)
    assert target_name(n["relu"]) == "torch.relu"
    assert target_name(n["block_0"]) == "block.0"
    assert target_name(n["add_"]) == "add_"
    assert target_name(n["add"]) == "_operator.add"


def test_module_path_of_module_calls_attributes_and_top_level_functions():
    gm = fx.symbolic_trace(Net())
    n = nodes(gm)
    assert module_path(n["block_0"]) == "block.0"
    assert module_path(n["w"]) == ""
    assert module_path(n["relu"]) == ""
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["nn_module_stack"] = {"a": ("encoder", nn.Module), "b": ("encoder.layer1", nn.Module)}
    assert module_path(x) == "encoder.layer1"


def test_mutates_first_arg_sees_inplace_operators_methods_and_modules():
    root = Net()
    gm = fx.symbolic_trace(root)
    n = nodes(gm)
    assert not mutates_first_arg(n["add"], gm)  # fx traces `y += 1` as an out-of-place add
    assert mutates_first_arg(n["add_"], gm)  # y.add_(1)
    assert mutates_first_arg(n["block_1"], gm)  # ReLU(inplace=True)
    assert not mutates_first_arg(n["relu"], gm)
    assert not mutates_first_arg(n["block_0"], gm)
    assert not mutates_first_arg(n["x"], gm)
    graph = fx.Graph()
    x = graph.placeholder("x")
    assert mutates_first_arg(graph.call_function(operator.iadd, (x, 1)), gm)
    assert mutates_first_arg(graph.call_function(operator.setitem, (x, 0, 1)), gm)
    assert mutates_first_arg(graph.call_function(torch.nn.functional.relu, (x,), {"inplace": True}), gm)
    assert mutates_first_arg(graph.call_function(torch.ops.aten.relu_.default, (x,)), gm)
    assert not mutates_first_arg(graph.call_function(torch.ops.aten.relu.default, (x,)), gm)


def test_canonical_names_give_tied_parameters_their_first_name():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    names = canonical_names(model)
    assert names[id(model[0].weight)] == "0.weight"
    assert sorted(names.values()) == ["0.bias", "0.weight", "1.bias"]


def test_node_parameters_of_modules_attributes_and_functions():
    gm = fx.symbolic_trace(Net())
    n = nodes(gm)
    assert [fqn for fqn, _ in node_parameters(n["out"], gm)] == ["out.weight", "out.bias"]
    assert [fqn for fqn, _ in node_parameters(n["w"], gm)] == ["w"]
    assert node_parameters(n["relu"], gm) == []
    assert node_parameters(n["block_1"], gm) == []  # ReLU has no parameters


def test_attr_tensor_finds_parameters_and_buffers_of_get_attr_nodes():
    net = Net()
    net.register_buffer("scale", torch.full((2,), 3.0))
    graph = fx.Graph()
    w, scale, missing = (graph.get_attr(t) for t in ("w", "scale", "nowhere"))
    assert attr_tensor(w, net) is net.w
    assert attr_tensor(scale, net) is net.scale
    assert attr_tensor(missing, net) is None
    gm = fx.symbolic_trace(net)
    assert attr_tensor(nodes(gm)["out"], gm) is None  # a module call, not a get_attr
