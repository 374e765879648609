"""pipecut.profile.fake: shapes, FLOPs, bytes and saved bytes counted on fake tensors equal the
real-tensor count, no real tensor is made, and identical blocks are counted once."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode

import pipecut
import pipecut.profile.fake
from examples import gpt, llama_meta, mlp, resnet, zoo
from pipecut.capture import capture
from pipecut.core.batching import first_microbatch
from pipecut.core.kinds import CostSource
from pipecut.core.meta import to_meta
from pipecut.errors import InputError
from pipecut.options import UNBOUNDED
from pipecut.profile.devices import count_costs
from pipecut.profile.fake import fake_work

THRESHOLD = 1 << 20
"""Estimation may make real tensors (the RNG state, a scalar constant) but none this large."""


class RealAllocations(TorchDispatchMode):
    """Records every real tensor (neither meta nor fake) an op makes in a storage none of its
    inputs has, with its bytes. Entered outside the estimate, it sees every op the estimate
    runs for real (fake tensors' ops reach it only as ops on meta tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        real = [t for t in pytree.tree_leaves((args, kwargs)) if _real(t)]
        held = {t.untyped_storage().data_ptr() for t in real}
        for t in pytree.tree_leaves(out):
            if _real(t) and t.untyped_storage().data_ptr() not in held:
                self.made.append((str(func), t.untyped_storage().nbytes()))
        return out

    def over(self, nbytes: int) -> list[tuple[str, int]]:
        return [(op, n) for op, n in self.made if n > nbytes]


def _real(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) and t.device.type != "meta"


def _counted(built: Any, microbatches: int = 2, real: bool = False, **kwargs: Any) -> Any:
    model, inputs, loss_fn, target = built
    _, first = first_microbatch(inputs, microbatches)
    size = len(pytree.tree_leaves(inputs)[0])
    first_target = target[: size // microbatches] if target is not None else None
    captured = capture(model, first, time_limit=UNBOUNDED)  # no bound: two captures give one graph under any load
    flat = captured.flatten_inputs(first)
    if real:
        return count_costs(captured, flat, loss_fn=loss_fn, target=first_target, real=True)
    return fake_work(captured, flat, loss_fn=loss_fn, target=first_target, **kwargs)


def _untimed(rows: Any) -> list[Any]:
    return [dataclasses.replace(r, forward_ms=0.0, backward_ms=0.0) for r in rows]


MODELS = {
    "mlp": lambda: mlp.build(batch_size=8),
    "gpt": lambda: gpt.build(batch_size=8),
    "resnet": lambda: resnet.build(batch_size=4),
    "gpt2": lambda: zoo.gpt2(batch_size=4),
    "llama": lambda: zoo.llama(batch_size=4),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_fake_count_equals_the_real_count(name: str) -> None:
    """FLOPs and bytes forward and backward, output, parameter and saved bytes, shapes, dtypes
    and leaves of every node: exactly those that running every node for real gives."""
    real_rows, real_work = _counted(MODELS[name](), real=True)
    fake_rows, fake_work_ = _counted(MODELS[name]())
    assert _untimed(fake_rows) == _untimed(real_rows)
    assert fake_work_ == real_work
    assert any(w.forward_flops > 0 and w.backward_flops > 0 for w in fake_work_.values())
    assert any(r.saved_bytes for r in fake_rows)


def test_estimate_costs_of_a_meta_llama_equals_the_real_llamas_reference() -> None:
    """A Llama built on meta, counted on fake tensors, gives the cost table that the same Llama
    with real weights gives when every node runs for real."""
    # eager attention: under SDPA (transformers' default) a meta capture has one layout copy per
    # layer that the CPU capture has not (docs/big-models.md), so their tables cannot be equal
    plain, inputs, loss_fn, target = zoo.llama(batch_size=4, attention="eager")
    with torch.device("meta"):
        meta = type(plain)(plain.config)
    kw: dict[str, Any] = dict(microbatches=2, loss_fn=loss_fn, target=target,
                              capture=pipecut.CaptureOptions(time_limit=UNBOUNDED))  # one graph under any load
    got = pipecut.estimate_costs(meta, inputs, "H100-SXM", **kw)
    want = pipecut.estimate_costs(plain, inputs, "H100-SXM", real=True, **kw)
    assert got == want
    assert {r.source for r in got} == {CostSource.ESTIMATED}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_identical_blocks_are_counted_once_with_the_same_rows(name: str, monkeypatch: Any) -> None:
    built = {"gpt": lambda: gpt.build(batch_size=4, layers=4),
             "llama": lambda: llama_meta.build("8b", batch_size=2, seq=64, hidden_size=64,
                                               intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=2, num_hidden_layers=4,
                                               vocab_size=256)}[name]
    counted = pipecut.profile.fake.node_work
    calls = [0]

    def counting(*args: Any) -> Any:
        calls[0] += 1
        return counted(*args)

    monkeypatch.setattr(pipecut.profile.fake, "node_work", counting)
    every = _counted(built(), reuse=False)
    every_calls, calls[0] = calls[0], 0
    once = _counted(built(), reuse=True)
    assert once == every
    # four blocks of the same shapes: the later three reuse the first's counts
    assert calls[0] < every_calls * 0.5, (calls[0], every_calls)


def test_estimation_makes_no_real_tensor() -> None:
    """A Llama-3.1-8B-shaped model on meta (2 of its layers) at 2 x 1,024 tokens: nothing real
    above 1 MiB is made (one activation of it would be 16 MiB)."""
    model, inputs, loss_fn, target = llama_meta.build("8b", batch_size=2, seq=1024, num_hidden_layers=2)
    with RealAllocations() as seen:
        rows = pipecut.estimate_costs(model, inputs, "H100-SXM", microbatches=1, loss_fn=loss_fn,
                                      target=target)
    assert seen.over(THRESHOLD) == []
    assert max(r.output_bytes for r in rows) >= 2 * 1024 * 128256 * 2  # the logits, counted


def test_a_real_model_with_real_inputs_is_not_copied() -> None:
    """The weights of a real model exist already: estimation neither copies nor runs them."""
    model, inputs, loss_fn, target = mlp.build(batch_size=512, width=1024, depth=2)
    with RealAllocations() as seen:
        pipecut.estimate_costs(model, inputs, "H100-SXM", microbatches=1, loss_fn=loss_fn, target=target)
    assert seen.over(THRESHOLD) == []


def test_the_allocation_check_catches_the_real_path() -> None:
    """The check can fail: counting by running every node (the path the CLI took before) makes
    activations of 2 MiB on the model above."""
    model, inputs, loss_fn, target = mlp.build(batch_size=512, width=1024, depth=2)
    with RealAllocations() as seen:
        pipecut.estimate_costs(model, inputs, "H100-SXM", microbatches=1, loss_fn=loss_fn, target=target,
                               real=True)
    assert seen.over(THRESHOLD), "the real path made nothing large: the check measures nothing"


def test_a_loss_that_is_not_a_scalar_is_refused_on_fake_tensors_too() -> None:
    model, inputs, _, target = mlp.build(batch_size=4)
    with pytest.raises(InputError, match=r"loss_fn must return a scalar tensor, got a tensor of shape \(2, 10\)"):
        pipecut.estimate_costs(model, inputs, microbatches=2, loss_fn=lambda out, t: out, target=target)


class Nonzero(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(x > 0).float().sum()


def test_a_value_dependent_shape_is_refused_with_the_real_path_as_the_fix() -> None:
    x = torch.randn(4, 3)
    with pytest.raises(InputError, match=r"node 'nonzero' \(torch.nonzero\) needs tensor values.*real=True"):
        pipecut.estimate_costs(Nonzero(), (x,))
    assert pipecut.estimate_costs(Nonzero(), (x,), real=True)  # the reference path runs it


@pytest.mark.parametrize("name", ["gpt", "gpt2"])
def test_meta_inputs_give_the_estimate_of_real_inputs(name: str) -> None:
    """Only the inputs' shapes and dtypes are read: meta inputs (symbolic_trace for gpt,
    torch.export for gpt2) give the very rows that real ones give."""
    model, inputs, loss_fn, target = MODELS[name]()
    want = pipecut.estimate_costs(model, inputs, microbatches=2, loss_fn=loss_fn, target=target)
    got = pipecut.estimate_costs(model, to_meta(inputs), microbatches=2, loss_fn=loss_fn,
                                 target=to_meta(target))
    assert got == want


def test_the_model_keeps_its_own_tensors_and_values() -> None:
    """The fake stand-ins are rebound only while counting (symbolic_trace's graph shares the
    model's modules): afterwards the model holds its very tensors, unchanged, BatchNorm
    statistics included."""
    model, inputs, loss_fn, target = resnet.build(batch_size=4)
    before = {n: (t, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}
    pipecut.estimate_costs(model, inputs, microbatches=2, loss_fn=loss_fn, target=target)
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert after.keys() == before.keys()
    for name, (tensor, value) in before.items():
        assert after[name] is tensor and not isinstance(after[name], FakeTensor)
        torch.testing.assert_close(after[name], value, rtol=0, atol=0)  # untouched: bit for bit


class Dropouts(torch.nn.Module):
    """Dropout as a module and as a function: 8 x 16 elements each."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(self.fc2(self.drop(self.fc1(x))), 0.2, self.training)


@pytest.mark.parametrize("method", ["symbolic_trace", "export"])
def test_a_count_for_a_gpu_keeps_its_dropout_masks_at_a_byte_an_element(method: str) -> None:
    """``gpu=True``: the fake count equals the real one under the same kernels, and each dropout
    keeps 8 x 16 x (4 - 1) = 384 bytes fewer than on the CPU (fp32 noise there, a bool mask on a
    GPU); every other row and all work are the CPU's."""
    model, x = Dropouts(), torch.randn(8, 8)
    captured = capture(model, (x,), method=method, time_limit=UNBOUNDED)
    flat = captured.flatten_inputs((x,))
    cpu_rows, cpu_work = fake_work(captured, flat)
    gpu_rows, gpu_work = fake_work(captured, flat, gpu=True)
    real_rows, real_work = count_costs(captured, flat, real=True, gpu=True)
    assert _untimed(gpu_rows) == _untimed(real_rows) and gpu_work == real_work == cpu_work
    fewer = {c.name: (c.saved_bytes or 0) - (g.saved_bytes or 0) for c, g in zip(cpu_rows, gpu_rows, strict=True)}
    dropouts = [n for n, d in fewer.items() if d]
    assert len(dropouts) == 2 and all(fewer[n] == 8 * 16 * 3 for n in dropouts), fewer
    # what each keeps on a GPU: its mask, 128 bytes, and, for the first, its output (fc2's input)
    assert sorted(r.saved_bytes for r in gpu_rows if r.name in dropouts) == [8 * 16, 8 * 16 * (4 + 1)]
