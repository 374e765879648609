"""pipecut.runtime.memory.activations: live activation bytes measured by saved-tensor hooks."""

from __future__ import annotations

import torch

from pipecut.runtime.memory.activations import ActivationMeter


def test_forward_counts_saved_activations_once_and_release_frees_them():
    w = torch.ones(4, 4, requires_grad=True)
    meter = ActivationMeter([w])
    x = torch.ones(2, 4, requires_grad=True)
    with meter.forward(0):
        y = (x @ w).sin()  # saves x (matmul) and x@w (sin); w is a parameter: not counted
    per_mb = meter.live
    assert per_mb == 2 * 2 * 4 * 4
    with meter.forward(1):
        (x @ w).sin()
    assert meter.live == meter.peak == 2 * per_mb  # each microbatch keeps its own (x too)
    meter.release(0)
    assert meter.live == per_mb
    meter.release(1)
    assert meter.live == 0 and meter.peak == 2 * per_mb
    with meter.forward(2):
        x * x  # saves x twice: one storage, counted once
    assert meter.live == 32
    y.sum().backward()


def test_kept_inputs_count_for_recompute():
    meter = ActivationMeter([])
    kept = torch.zeros(8)
    with meter.forward(0, kept_inputs=[kept, kept]):
        pass
    assert meter.live == 32


def test_sends_hold_memory_until_dropped_unless_already_counted():
    meter = ActivationMeter([])
    act = torch.ones(3, requires_grad=True)
    with meter.forward(0):
        out = act.exp()  # exp saves its output
    assert meter.live == 12
    sent_new = torch.zeros(10)
    meter.hold(7, [out, sent_new])  # out is an activation already
    assert meter.live == 52 and meter.sending == 40 and meter.peak_sending == 40
    meter.drop(7)
    assert meter.live == 12 and meter.sending == 0 and meter.peak == 52
    meter.reset()
    assert (meter.live, meter.peak, meter.peak_sending) == (0, 0, 0)


def test_a_graph_kept_for_a_split_backward_is_freed_after_its_weight_pass():
    # tanh saves its own output. Had the meter's pack hook handed that output back as it was,
    # the graph would hold a tensor whose grad_fn is the graph: a cycle through C++ that only
    # a backward without retain_graph breaks. Zero-bubble keeps graphs for its weight pass, so
    # every microbatch's activations leaked (220 MiB per step on the GPT-2 benchmark).
    import gc
    import weakref

    from pipecut.runtime.execution.backward_split import split_backward

    meter = ActivationMeter([])
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    with meter.forward(0):
        hidden = torch.tanh(x @ w)
        out = (hidden * 2).sum()
    alive = weakref.ref(hidden)
    del hidden
    input_grads, weight_pass = split_backward([out], [torch.ones_like(out)], [x], [w])
    weight_pass()
    del out, weight_pass
    gc.collect()
    assert alive() is None, "the graph and what it saved outlived the step"
    assert input_grads[0] is not None and w.grad is not None
