"""Capture: symbolic_trace first, torch.export second, one clear error when both fail."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from examples import mlp
from pipecut.capture import capture, fingerprint
from pipecut.core.kinds import CaptureMethod
from pipecut.errors import CaptureError, InputError


class ShapeLoop(nn.Module):
    """Iterates over a tensor's shape: symbolic_trace cannot, torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in x.shape:
            x = self.lin(x)
        return x


class DataDependent(nn.Module):
    """Branches on a tensor's value: neither method can capture it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x


def test_symbolic_trace_first() -> None:
    model, inputs, _, _ = mlp.build()
    cap = capture(model, inputs)
    assert cap.method is CaptureMethod.SYMBOLIC_TRACE
    torch.testing.assert_close(cap.gm(*cap.flatten_inputs(inputs)), model(*inputs))


def test_export_fallback_keeps_parameter_objects() -> None:
    model = ShapeLoop()
    x = torch.randn(2, 4)
    cap = capture(model, (x,))
    assert cap.method is CaptureMethod.EXPORT
    assert cap.gm.get_parameter("lin.weight") is model.lin.weight
    out = next(n for n in cap.gm.graph.nodes if n.op == "output")
    flat = fx.Interpreter(cap.gm).run(*cap.flatten_inputs((x,)))  # pytree codegen unflattens
    torch.testing.assert_close(flat, model(x))
    assert cap.unflatten_output(tuple(out.args[0])) is not None
    assert cap.unflatten_output((flat,)) is flat


def test_both_failing_names_each_attempt_and_the_fixes() -> None:
    with pytest.raises(CaptureError, match=r"(?s)symbolic_trace.*torch.export.*leaf_modules"):
        capture(DataDependent(), (torch.randn(2),))


def test_inputs_must_be_tuple_or_dict() -> None:
    model, inputs, _, _ = mlp.build()
    with pytest.raises(InputError, match=r"wrap a single tensor as \(x,\)"):
        capture(model, inputs[0])
    cap = capture(model, inputs)
    with pytest.raises(InputError, match="unknown input"):
        cap.flatten_inputs({"y": inputs[0]})
    assert cap.flatten_inputs({"x": inputs[0]})[0] is inputs[0]


def test_fingerprint_is_stable_and_model_specific() -> None:
    a, inputs, _, _ = mlp.build(seed=0)
    b, _, _, _ = mlp.build(seed=1)  # same architecture, other weights: same plan applies
    c, _, _, _ = mlp.build(depth=3)
    assert fingerprint(capture(a, inputs).gm) == fingerprint(capture(b, inputs).gm)
    assert fingerprint(capture(a, inputs).gm) != fingerprint(capture(c, inputs).gm)


def test_a_transformers_model_with_its_default_kv_cache_is_captured_and_left_as_it_was() -> None:
    """``LlamaForCausalLM(config)`` asks for a key/value cache by default (``use_cache=True``),
    whose ``DynamicCache`` output torch.export cannot return: capture exports without it and puts
    the config back. The graph's logits are the model's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8)
    model = transformers.LlamaForCausalLM(config)
    assert model.config.use_cache is True  # the library's default, which this test keeps
    ids = torch.randint(0, 32, (2, 8))
    captured = capture(model, {"input_ids": ids})
    assert captured.method is CaptureMethod.EXPORT and model.config.use_cache is True
    out = captured.gm(input_ids=ids)
    assert out.past_key_values is None  # captured as with use_cache=False
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits, rtol=0, atol=0)
