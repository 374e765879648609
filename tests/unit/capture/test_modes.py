"""pipecut.capture.modes: module modes, state reads and shared state across the two modes' graphs.

Deriving the other mode's graph and the :class:`Modes` switch are tested with the pass that
maps its nodes onto stages, in ``test_eval_graph.py``.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from pipecut.capture import capture
from pipecut.capture.modes import (
    capture_in_mode,
    module_modes,
    share_state,
    state_names,
    state_reads,
)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        h = self.norm(self.fc(x)) * self.scale
        return nn.functional.dropout(h, 0.5, self.training)


def test_capture_in_mode_captures_the_other_mode_and_restores_module_modes():
    model = Net().train()
    model.norm.eval()  # a per-module mode the capture must give back
    before = module_modes(model)
    assert dict(before)["norm"] is False and dict(before)[""] is True
    x = torch.randn(4, 4)
    train = capture(model, (x,))
    evaluated = capture_in_mode(model, (x,), False, train, ())
    assert module_modes(model) == before

    def dropout_training(c):
        return next(n.kwargs["training"] for n in c.gm.graph.nodes if n.name == "dropout")

    assert dropout_training(train) is True and dropout_training(evaluated) is False  # fixed by capture


def test_state_reads_name_what_each_node_reads_by_canonical_name():
    model = Net()
    gm = fx.symbolic_trace(model)
    names = state_names(gm)
    assert names[id(model.fc.weight)] == "fc.weight"
    assert names[id(model.norm.running_mean)] == "norm.running_mean"
    reads = state_reads(gm, names)
    assert reads["fc"] == ("fc.weight", "fc.bias")
    assert set(reads["norm"]) >= {"norm.weight", "norm.bias", "norm.running_mean", "norm.running_var"}
    assert reads["mul"] == ("scale",)  # through its get_attr input
    assert "x" not in reads and "scale" not in reads  # placeholders and get_attr are not units


def test_share_state_points_a_graph_at_the_other_graphs_tensors():
    a, b = fx.symbolic_trace(Net()), fx.symbolic_trace(Net())
    share_state(b, a)
    assert b.fc.weight is a.fc.weight and b.scale is a.scale
    assert b.norm.running_mean is a.norm.running_mean  # buffers too
    assert dict(b.named_parameters()).keys() == dict(a.named_parameters()).keys()
