"""Backward split into input and weight gradients gives exactly the whole backward's gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pipecut
from examples import EXAMPLES
from pipecut.capture import as_planned, capture
from pipecut.errors import ScheduleError
from pipecut.passes.rewrite.split import split
from pipecut.runtime.execution.backward_split import split_backward
from pipecut.schedules.format import ActionKind, format_schedule, validate
from pipecut.schedules.simulate import simulate, timeline
from pipecut.schedules.standard import one_f_one_b
from pipecut.schedules.zero_bubble import zero_bubble


def _stage_runs(name: str, k: int) -> list[dict[str, Any]]:
    """Each stage run on fresh leaves (as a rank sees them), with the gradient it receives."""
    model, inputs, loss_fn, target = EXAMPLES[name](batch_size=4)
    model.eval()
    plan = pipecut.plan(
        model, inputs, k, loss_fn=loss_fn, target=target, microbatches=1, schedule="gpipe",
        measure=pipecut.MeasureOptions(estimate="A100-80GB"),  # counted costs: the same plan under any load
    )
    cap = as_planned(capture(model, inputs), plan.chunked)  # the plan's graph (a heavy node in row pieces)
    flat = dict(zip(cap.input_names, cap.flatten_inputs(inputs)))
    runs, received = [], ()
    for prog in split(cap.gm, plan):
        leaves = tuple(
            t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t
            for t in received
        )
        out = prog.module(*leaves, *(flat[n] for n in prog.model_inputs))
        if prog.is_last:
            outputs = [loss_fn(cap.unflatten_output(out), target)]
        else:
            outputs = [t for t in out if isinstance(t, torch.Tensor) and t.requires_grad]
        torch.manual_seed(prog.index)
        grads = [torch.ones_like(outputs[0])] if prog.is_last else [torch.randn_like(t) for t in outputs]
        runs.append({
            "outputs": outputs, "grads": grads, "module": prog.module,
            "inputs": [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad],
        })
        received = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in out) if not prog.is_last else ()
    return runs


@pytest.mark.parametrize("name", ["gpt", "resnet", "mlp"])
def test_input_then_weight_pass_equals_the_whole_backward(name: str) -> None:
    for run in _stage_runs(name, 3):
        params = list(run["module"].parameters())
        want = torch.autograd.grad(run["outputs"], run["inputs"] + params, run["grads"],
                                   retain_graph=True, allow_unused=True)
        for p in params:
            p.grad = None
        input_grads, weight_pass = split_backward(run["outputs"], run["grads"], run["inputs"], params)
        assert all(p.grad is None for p in params)  # nothing of the weight part has run yet
        weight_pass()
        got = list(input_grads) + [p.grad for p in params]
        for g, w in zip(got, want):
            if w is None:
                assert g is None or not g.any()
            else:
                # The same products, split across two autograd calls: equal up to summation
                # order where one weight is read twice (the tied embedding).
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_zero_bubble_order_is_valid_and_fills_bubbles() -> None:
    assert format_schedule(zero_bubble(2, 4, [1, 1], [2, 2], [1, 1])) == (
        "0F0 0F1 0I0 0W0 0F2 0I1 0W1 0F3 0I2 0W2 0I3 0W3\n"
        "1F0 1I0 1W0 1F1 1I1 1W1 1F2 1I2 1W2 1F3 1I3 1W3"
    )
    for k, m in [(2, 8), (3, 6), (4, 8), (4, 16)]:
        zb = zero_bubble(k, m, [1] * k, [2] * k, [1] * k)
        validate(zb, m)
        ours = simulate(zb, [1] * k, [2] * k, weight_ms=[1] * k)
        assert ours < simulate(one_f_one_b(k, m), [1] * k, [2] * k)
        assert ours >= 3 * m  # never below the work of one rank


def test_weight_before_input_is_refused() -> None:
    from pipecut.schedules.format import parse_schedule

    with pytest.raises(ScheduleError, match="before its input part"):
        validate(parse_schedule("0F0 0W0 0I0"), 1)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 5), st.integers(1, 8), st.data())
def test_list_scheduling_keeps_1f1b_memory_and_never_idles_with_weight_work(k, m, data) -> None:  # type: ignore[no-untyped-def]
    times = st.floats(0.0, 3.0, allow_nan=False)
    f = data.draw(st.lists(times, min_size=k, max_size=k))
    w = data.draw(st.lists(times, min_size=k, max_size=k))
    b = [wi + x for wi, x in zip(w, data.draw(st.lists(times, min_size=k, max_size=k)))]
    fl = data.draw(st.lists(times, min_size=k - 1, max_size=k - 1))
    zb = zero_bubble(k, m, f, b, w, fl)
    validate(zb, m)
    spans = timeline(zb, f, b, fl, weight_ms=w)
    for s in range(k):
        in_flight = pending = 0
        mine = [(a, start, end) for a, start, end in spans if a.stage == s]
        prev_end = 0.0
        for a, start, end in mine:
            # A rank waits only when it has no weight part to run.
            assert start <= prev_end + 1e-9 or pending == 0, (s, a)
            in_flight += a.kind is ActionKind.FORWARD
            in_flight -= a.kind is ActionKind.WEIGHT
            pending += (a.kind is ActionKind.INPUT) - (a.kind is ActionKind.WEIGHT)
            assert in_flight <= k - s  # 1F1B's activation memory
            prev_end = end
