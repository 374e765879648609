"""profile.signature.cost_key: identical blocks share a key, any difference in op or input does not."""

from __future__ import annotations

import torch
import torch.fx as fx

from pipecut.profile.signature import cost_key


class Twins(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.wide = torch.nn.Linear(8, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wide(self.b(self.a(x)))


def _keys(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, object]:
    keys = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            keys[node.name] = cost_key(node, gm, (x,), {}, inplace=False)
    return keys


def test_identical_modules_on_identical_inputs_share_a_key() -> None:
    gm = fx.symbolic_trace(Twins())
    keys = _keys(gm, torch.randn(4, 8))
    assert keys["a"] is not None and keys["a"] == keys["b"]
    assert keys["wide"] != keys["a"]  # another configuration (out_features)


def test_input_shape_dtype_and_grad_are_part_of_the_key() -> None:
    gm = fx.symbolic_trace(Twins())
    node = next(n for n in gm.graph.nodes if n.name == "a")
    base = cost_key(node, gm, (torch.randn(4, 8),), {}, inplace=False)
    assert cost_key(node, gm, (torch.randn(2, 8),), {}, inplace=False) != base
    assert cost_key(node, gm, (torch.randn(4, 8, dtype=torch.float64),), {}, inplace=False) != base
    assert cost_key(node, gm, (torch.randn(4, 8, requires_grad=True),), {}, inplace=False) != base
    assert cost_key(node, gm, (torch.randn(4, 8),), {}, inplace=True) != base


def test_training_mode_is_part_of_the_key() -> None:
    gm = fx.symbolic_trace(Twins())
    node = next(n for n in gm.graph.nodes if n.name == "a")
    x = torch.randn(4, 8)
    train = cost_key(node, gm, (x,), {}, inplace=False)
    gm.a.eval()
    assert cost_key(node, gm, (x,), {}, inplace=False) != train
