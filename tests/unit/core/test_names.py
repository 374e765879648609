"""pipecut.core.names: the user's model's names for a captured graph's tensors."""

from __future__ import annotations

import torch
from torch import fx, nn

from pipecut.core.names import model_names


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("scratch", torch.zeros(1), persistent=False)

    def forward(self, x):
        return self.head(self.embed(x) * self.scale + self.scratch)


def test_graph_names_map_to_the_models_first_name_and_state_keys():
    model = Tied()
    gm = fx.symbolic_trace(model)
    names = model_names(gm, model)
    assert names.public("embed.weight") == "embed.weight"
    assert names.public("scale") == "scale"
    assert names.state["embed.weight"] == ("embed.weight", "head.weight")  # tied: both keys
    assert names.state["scale"] == ("scale",)
    assert names.state["scratch"] == ()  # non-persistent: not in the state dict


def test_an_alias_graph_name_maps_to_the_models_first_name():
    model = Tied()
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    gm.register_parameter("head_weight", model.head.weight)  # the graph kept the other alias
    gm.register_buffer("lifted_tensor_0", torch.zeros(1))  # not the model's
    names = model_names(gm, model)
    assert names.public("head_weight") == "embed.weight"
    assert names.public("lifted_tensor_0") is None
    assert "lifted_tensor_0" not in names.state


def test_a_copy_under_the_models_own_name_is_matched_by_name():
    model = Tied()
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    gm.register_buffer("scale", torch.ones(4))  # a different tensor, same name
    assert model_names(gm, model).public("scale") == "scale"
