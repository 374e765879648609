"""pipecut.profile.saved: what autograd keeps for backward, charged to the node that made it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import pipecut
from examples import gpt
from pipecut.core.batching import split_microbatches
from pipecut.profile.saved import GpuDropout, SavedBytes


def test_a_saved_input_is_charged_to_its_producer_and_own_tensors_to_the_node() -> None:
    w = torch.nn.Parameter(torch.randn(8, 8))
    saved = SavedBytes([w])
    x = torch.randn(4, 8, requires_grad=True)
    saved.produced("x", x)
    h = saved.run("mm", (x,), lambda: x @ w)  # keeps x (x's) and w (a weight: nobody's)
    v = saved.run("view", (h,), lambda: h.view(2, 16))  # a view: keeps nothing, owns nothing
    s = saved.run("softmax", (v,), lambda: v.softmax(-1))  # keeps its own output
    saved.run("sum", (s,), lambda: s.sum())  # keeps nothing
    assert saved.bytes_of("x") == 4 * 8 * 4
    assert saved.bytes_of("mm") == 0 and saved.bytes_of("view") == 0 and saved.bytes_of("sum") == 0
    assert saved.bytes_of("softmax") == 2 * 16 * 4
    y = saved.run("relu_of_view", (v,), lambda: v.relu())  # saves its output (its own)
    saved.run("mul", (v, y), lambda: v * y)  # saves v (a view of mm's storage: mm's) and y
    assert saved.bytes_of("mm") == 4 * 8 * 4 and saved.bytes_of("relu_of_view") == 2 * 16 * 4
    tokens = torch.randint(0, 8, (4,))
    saved.produced(None, tokens)  # a model input: charged to whoever keeps it
    table = torch.nn.Parameter(torch.randn(8, 3))
    saved.run("embedding", (tokens,), lambda: torch.nn.functional.embedding(tokens, table))
    assert saved.bytes_of("embedding") == 4 * 8


def test_profiling_records_what_is_kept_and_the_planner_counts_it() -> None:
    model, inputs, loss_fn, target = gpt.build()
    plan = pipecut.plan(
        model, inputs, 2, loss_fn=loss_fn, target=target, microbatches=2,
        measure=pipecut.MeasureOptions(repeats=1, warmup=0),
    )
    calls = [n for n in plan.nodes if n.op.value.startswith("call_")]
    assert all(n.saved_bytes is not None for n in calls)
    kept, outputs = sum(n.kept_bytes for n in calls), sum(n.output_bytes for n in calls)
    assert 0 < kept < outputs  # many outputs are never saved (views, what only a sum reads)
    assert plan.node(plan.stages[-1].nodes[-1]).saved_bytes  # the loss keeps its softmax
    # What the plain model keeps for one microbatch's backward (unique storages, weights
    # excluded): the plan's per-node charges add up to it.
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    x, y = split_microbatches(inputs, 2, target.shape[0])[0], split_microbatches(target, 2, target.shape[0])[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss_fn(model(*x), y)
    charged = sum(n.saved_bytes or 0 for n in plan.nodes)  # the loss's and the inputs' too
    assert charged == sum(seen.values())


DROPOUTS = {
    "F.dropout": lambda x: F.dropout(x, 0.1),
    "nn.Dropout": lambda x: torch.nn.Dropout(0.1)(x),
    "torch.dropout": lambda x: torch.dropout(x, 0.1, True),
    "aten.dropout": lambda x: torch.ops.aten.dropout.default(x, 0.1, True),  # a torch.export graph's
}


@pytest.mark.parametrize("spelling", sorted(DROPOUTS))
def test_a_gpus_dropout_keeps_a_one_byte_mask_where_the_cpus_keeps_noise_of_the_inputs_dtype(spelling: str) -> None:
    """The CPU's dropout multiplies by a noise tensor of the input's dtype and keeps it; CUDA's
    fused native_dropout keeps a bool mask. 4 x 16 elements: 128 bytes of bf16 noise, 64 of mask."""
    dropout = DROPOUTS[spelling]
    x = torch.randn(4, 16, dtype=torch.bfloat16, requires_grad=True)
    cpu, gpu = SavedBytes([]), SavedBytes([])
    cpu.run("dropout", (x,), lambda: dropout(x))
    with GpuDropout():
        y = gpu.run("dropout", (x,), lambda: dropout(x))
    assert cpu.bytes_of("dropout") == 4 * 16 * 2
    assert gpu.bytes_of("dropout") == 4 * 16 * 1
    # still dropout: zeros and x / (1 - p), bf16, and the gradient through the mask
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    kept = y != 0
    torch.testing.assert_close(y[kept], (x / 0.9).to(torch.bfloat16)[kept])
    y.float().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, (kept / 0.9).to(torch.bfloat16))


@pytest.mark.parametrize(("case", "dropout"), [
    ("in place (the composite kernel on a GPU too)", lambda x: F.dropout(x * 1, 0.1, inplace=True)),
    ("p = 0", lambda x: F.dropout(x * 1, 0.0)),
    ("eval", lambda x: F.dropout(x * 1, 0.1, training=False)),
    ("p = 1", lambda x: F.dropout(x * 1, 1.0)),
])
def test_what_a_gpu_runs_as_the_cpu_does_is_left_as_it_is(case: str, dropout) -> None:
    x = torch.randn(4, 16, requires_grad=True)
    cpu, gpu = SavedBytes([]), SavedBytes([])
    cpu.run("dropout", (x,), lambda: dropout(x))
    with GpuDropout():
        gpu.run("dropout", (x,), lambda: dropout(x))
    assert gpu.bytes_of("dropout") == cpu.bytes_of("dropout"), case
