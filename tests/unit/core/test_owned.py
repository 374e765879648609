"""core.owned: a stage's own module objects over the model's tensors."""

from __future__ import annotations

import torch

from pipecut.core.owned import own_modules, own_path


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.MultiheadAttention(4, 2), torch.nn.BatchNorm1d(4))


def test_owned_modules_share_tensors_and_keep_their_own_slots() -> None:
    model = _model()
    stage = torch.nn.Module()
    stage.add_module("body", model)  # a stage holding the model's own modules, as GraphModule does
    slots = {n: p for n, p in model.named_parameters()}
    owned = own_modules(stage)
    assert stage.body is not model and stage.body[1].out_proj is not model[1].out_proj  # nested too
    assert {id(m) for m in stage.body.modules()} <= owned
    assert all(p is slots[n] for n, p in stage.body.named_parameters())  # the tensors are shared
    stage.body[1].out_proj.weight = torch.nn.Parameter(torch.zeros(4, 4))  # a slot swapped in the stage...
    stage.body[2].running_mean = torch.ones(4)
    assert model[1].out_proj.weight is slots["1.out_proj.weight"]  # ...is not swapped in the model
    assert torch.equal(model[2].running_mean, torch.zeros(4))


def test_own_path_copies_each_module_once_and_leaves_the_root() -> None:
    model = _model()
    owned: set[int] = set()
    first = own_path(model, "1.out_proj", owned)
    again = own_path(model, "1.out_proj", owned)
    assert first is again and own_path(model, "", owned) is model
    assert len(owned) == 2  # the attention module and its out_proj
