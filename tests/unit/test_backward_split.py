"""pipecut.runtime.backward_split: input gradients first, weight gradients later, equal to one backward."""

from __future__ import annotations

import torch
from torch import nn

from pipecut.runtime.backward_split import split_backward


def stage() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3))


def reference(model, x, grad):
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    model(x).backward(grad)
    return x.grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_input_then_weight_gradients_equal_one_backward():
    model = stage()
    x0, grad = torch.randn(5, 4), torch.randn(5, 3)
    want_x, want_params = reference(model, x0, grad)
    model.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = model(x)
    input_grads, weight_pass = split_backward([out], [grad], [x], list(model.parameters()))
    assert torch.allclose(input_grads[0], want_x)
    assert all(p.grad is None for p in model.parameters())  # nothing written before W
    weight_pass()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want_params[n], atol=1e-6), n


def test_weight_gradients_accumulate_and_frozen_parameters_get_none():
    model = stage()
    model[0].weight.requires_grad_(False)
    x0, grad = torch.randn(5, 4), torch.randn(5, 3)
    _, want = reference(model, x0, grad)
    for p in model.parameters():
        p.grad = None if not p.requires_grad else torch.ones_like(p)
    x = x0.clone().requires_grad_()
    _, weight_pass = split_backward([model(x)], [grad], [x], list(model.parameters()))
    weight_pass()
    assert model[0].weight.grad is None
    assert torch.allclose(model[2].weight.grad, want["2.weight"] + 1, atol=1e-6)


def test_a_first_stage_without_inputs_leaves_everything_to_the_weight_pass():
    model = stage()
    x0, grad = torch.randn(5, 4), torch.randn(5, 3)
    _, want = reference(model, x0, grad)
    model.zero_grad(set_to_none=True)
    input_grads, weight_pass = split_backward([model(x0)], [grad], [], list(model.parameters()))
    assert input_grads == []
    weight_pass()
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-6), n
