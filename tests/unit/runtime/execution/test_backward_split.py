"""pipecut.runtime.execution.backward_split: input gradients first, weight gradients later, equal to one backward."""

from __future__ import annotations

import torch
from torch import nn

from pipecut.runtime.execution.backward_split import split_backward


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


def test_the_graph_and_its_saved_tensors_are_freed_without_the_cyclic_collector():
    # The splitter's bookkeeping once formed a reference cycle that held the whole autograd
    # graph until gc ran: zero-bubble steps grew by ~220 MiB each on the GPT-2 benchmark.
    import gc
    import weakref

    model = stage()
    for first_stage in (False, True):
        x = torch.randn(5, 4, requires_grad=not first_stage)
        hidden = model[1](model[0](x))  # saved by the second Linear for its weight gradient
        saved = weakref.ref(hidden)
        out = model[3](model[2](hidden))
        del hidden
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            _, weight_pass = split_backward([out], [torch.ones_like(out)], [x] if not first_stage else [],
                                            list(model.parameters()))
            weight_pass()
            del out, weight_pass
            assert saved() is None, "the graph outlived its weight pass"
        finally:
            if was_enabled:
                gc.enable()


def test_a_deep_graph_does_not_hit_the_recursion_limit():
    import sys

    layers = nn.Sequential(*[nn.Linear(2, 2) for _ in range(sys.getrecursionlimit())])
    x = torch.randn(1, 2, requires_grad=True)
    out = layers(x)
    input_grads, weight_pass = split_backward([out], [torch.ones_like(out)], [x], list(layers.parameters()))
    weight_pass()
    assert input_grads[0] is not None and layers[0].weight.grad is not None


# --- graphs where a parameter's gradient reaches it along several paths ------------------------
# Each model below is a stage whose parameters are reached from a node on the input path both
# directly and through that path (a shared layer, a residual stream, a tied weight), or whose
# parameters autograd hands the same gradient tensor: the shapes zero-bubble got wrong on ALBERT,
# T5, BART and ViT (issue 27).


class SharedLayer(nn.Module):
    """ALBERT: one LayerNorm and one Linear applied by every layer (weights used directly by
    several nodes on the input path)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.lin = nn.LayerNorm(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            x = self.norm(x + torch.tanh(self.lin(x)))
        return x


class Decoder(nn.Module):
    """T5/BART's decoder stage: an embedding of the decoder's own tokens (reaching no input),
    a self-attention-like block over it, then a cross block with the encoder output (the stage
    input) joined by a residual add, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.q, self.k = nn.Embedding(11, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.self_mix, self.norm = nn.Linear(6, 6), nn.LayerNorm(6)

    def forward(self, enc: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        h = h + self.self_mix(self.norm(h))
        scores = torch.softmax(self.q(h) @ self.k(enc).transpose(-1, -2), dim=-1)
        h = h + scores @ enc
        return self.norm(h) @ self.emb.weight.T


class Patches(nn.Module):
    """ViT's embeddings: a class token and a position table added to the (received) patches;
    with one sample, the add's two gradients are the same tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, 6))
        self.pos = nn.Parameter(torch.randn(1, 5, 6))
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.lin(h)


def _check_split_equals_one_backward(model: nn.Module, inputs: list[torch.Tensor], extra=(),
                                     microbatches: int = 2) -> None:
    """Two microbatches of input passes, then their weight passes (as zero-bubble runs them),
    against a plain backward of each microbatch: input and parameter gradients."""
    torch.manual_seed(1)
    data = [[t.clone() for t in inputs] for _ in range(microbatches)]
    for d in data:
        for t in d:
            t.add_(torch.randn_like(t))
    model.zero_grad(set_to_none=True)
    want_inputs, out_grads = [], []
    for d in data:
        leaves = [t.clone().requires_grad_() for t in d]
        out = model(*leaves, *extra)
        out_grads.append(torch.randn_like(out))  # not constant: a norm's input would get zero
        out.backward(out_grads[-1])
        want_inputs.append([t.grad for t in leaves])
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    passes = []
    for d, w, grad in zip(data, want_inputs, out_grads):
        leaves = [t.clone().requires_grad_() for t in d]
        out = model(*leaves, *extra)
        got, weight_pass = split_backward([out], [grad], leaves, list(model.parameters()))
        for g, wg in zip(got, w):
            torch.testing.assert_close(g, wg)
        passes.append(weight_pass)
    for weight_pass in passes:
        weight_pass()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=lambda m, n=n: f"{n}: {m}")


def test_a_layer_shared_by_every_layer_gets_each_use_once():
    torch.manual_seed(0)
    _check_split_equals_one_backward(SharedLayer(), [torch.randn(4, 6)])


def test_a_residual_stream_and_a_tied_head_on_a_decoder_stage():
    torch.manual_seed(0)
    _check_split_equals_one_backward(Decoder(), [torch.randn(2, 5, 6)], extra=(torch.randint(0, 11, (2, 3)),))


def test_parameters_handed_one_gradient_tensor_by_autograd_do_not_share_it():
    torch.manual_seed(0)
    _check_split_equals_one_backward(Patches(), [torch.randn(1, 4, 6)])  # one sample
    _check_split_equals_one_backward(Patches(), [torch.randn(3, 4, 6)])


def test_the_weight_gradients_are_fresh_tensors_in_the_parameters_layout():
    model = Patches()
    x = torch.randn(1, 4, 6, requires_grad=True)
    out = model(x)
    (got,), weight_pass = split_backward([out], [torch.ones_like(out)], [x], list(model.parameters()))
    weight_pass()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == len(list(model.parameters())) and got.untyped_storage().data_ptr() not in storages
    assert all(p.grad.stride() == p.stride() for p in model.parameters())


class _Scale(torch.autograd.Function):
    """``x * w`` as a Python autograd function: its backward node is not a C++ node."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(0)


class SharedScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Scale.apply(torch.tanh(_Scale.apply(x, self.w)), self.w)


def test_a_shared_parameter_below_a_python_autograd_function():
    torch.manual_seed(0)
    _check_split_equals_one_backward(SharedScale(), [torch.randn(4, 6)])
