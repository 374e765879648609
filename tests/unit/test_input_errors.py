"""Inputs of the wrong structure are refused in words: what was passed, what the plan expects.

Regression (issue 27): ``pipe.step`` with inputs of another structure than the captured one
printed two ``TreeSpec`` reprs, e.g. for a Llama captured with ``{"input_ids": ids}`` and
stepped with ``(ids,)``::

    InputError: inputs are structured as TreeSpec(tuple, None, [TreeSpec(tuple, None, [*]),
      TreeSpec(dict, [], [])]), the captured graph expects TreeSpec(tuple, None, [TreeSpec(tuple,
      None, []), TreeSpec(dict, ['input_ids'], [*])])

Now the message says what was passed and what the plan was captured with (the placeholders'
names), then the first difference that matters and the fix; the pytree structures follow as
detail. Both capture paths: torch.export (a structure fixed at capture) and symbolic_trace
(placeholders taken by position or keyword). ``pipe.step`` passes ``what="step"``; the
multi-rank check of that is in ``tests/multiprocess/test_freeze.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from examples import mlp, zoo
from pipecut.capture import capture
from pipecut.core.kinds import CaptureMethod
from pipecut.core.program import Captured
from pipecut.errors import InputError


@pytest.fixture(scope="module")
def llama() -> tuple[Captured, torch.Tensor]:
    """A Llama captured by torch.export with one keyword input, ``input_ids``."""
    model, inputs, _, _ = zoo.llama(batch_size=2)
    captured = capture(model, inputs)
    assert captured.method is CaptureMethod.EXPORT and captured.input_names == ("input_ids",)
    return captured, inputs["input_ids"]


@pytest.fixture(scope="module")
def exported_mlp() -> tuple[Captured, torch.Tensor]:
    """An MLP captured by torch.export with one positional input, ``x``."""
    model, (x,), _, _ = mlp.build(batch_size=2, width=8, depth=2)
    captured = capture(model, (x,), method=CaptureMethod.EXPORT)
    assert captured.input_names == ("x",)
    return captured, x


def _refused(captured: Captured, inputs: Any) -> str:
    with pytest.raises(InputError) as info:
        captured.flatten_inputs(inputs, "step")
    return str(info.value)


def test_positional_instead_of_keyword_says_to_pass_a_dict(llama: tuple[Captured, torch.Tensor]) -> None:
    captured, ids = llama
    with pytest.raises(InputError, match=r"^step got 1 positional input \(tensor\[2, 16\]\); the plan was "
                                         r"captured with 1 keyword input \(input_ids\): pass them as "
                                         r"keywords, a dict \{'input_ids': \.\.\.\}"):
        captured.flatten_inputs((ids,), "step")


def test_keyword_instead_of_positional_says_to_pass_a_tuple(exported_mlp: tuple[Captured, torch.Tensor]) -> None:
    captured, x = exported_mlp
    with pytest.raises(InputError, match=r"^step got 1 keyword input \(x=tensor\[2, 8\]\); the plan was "
                                         r"captured with 1 positional input \(x\): pass them as "
                                         r"positionals, a tuple \(x,\)"):
        captured.flatten_inputs({"x": x}, "step")


def test_wrong_count(exported_mlp: tuple[Captured, torch.Tensor], llama: tuple[Captured, torch.Tensor]) -> None:
    captured, x = exported_mlp
    with pytest.raises(InputError, match=r"^step got 2 positional inputs \(tensor\[2, 8\], tensor\[2, 8\]\); "
                                         r"the plan was captured with 1 positional input \(x\) \(pytree"):
        captured.flatten_inputs((x, x), "step")
    with pytest.raises(InputError, match=r"^step got no inputs; the plan was captured with 1 positional input \(x\)"):
        captured.flatten_inputs((), "step")
    captured, ids = llama
    with pytest.raises(InputError, match=r"^step got 2 positional inputs .*; the plan was captured with "
                                         r"1 keyword input \(input_ids\): pass them as keywords"):
        captured.flatten_inputs((ids, ids), "step")


def test_wrong_keys_name_the_unknown_and_the_missing(llama: tuple[Captured, torch.Tensor]) -> None:
    captured, ids = llama
    with pytest.raises(InputError, match=r"^step got 1 keyword input \(ids=tensor\[2, 16\]\); the plan was "
                                         r"captured with 1 keyword input \(input_ids\): unknown input\(s\) "
                                         r"\['ids'\]; missing keyword\(s\) \['input_ids'\]"):
        captured.flatten_inputs({"ids": ids}, "step")
    with pytest.raises(InputError, match=r"^step got 2 keyword inputs \(input_ids=tensor\[2, 16\], "
                                         r"attention_mask=tensor\[2, 16\]\); .*: unknown input\(s\) "
                                         r"\['attention_mask'\] \(pytree"):
        captured.flatten_inputs({"input_ids": ids, "attention_mask": ids}, "step")


def test_nested_structure_names_the_input_and_both_shapes(
    llama: tuple[Captured, torch.Tensor], exported_mlp: tuple[Captured, torch.Tensor]
) -> None:
    captured, ids = llama
    with pytest.raises(InputError, match=r"^step got 1 keyword input \(input_ids=\(tensor\[2, 16\],\)\); .*: "
                                         r"keyword input 'input_ids' is \(tensor\[2, 16\],\), captured as "
                                         r"one value \(input_ids\)"):
        captured.flatten_inputs({"input_ids": (ids,)}, "step")
    captured, x = exported_mlp
    with pytest.raises(InputError, match=r"positional input 0 is \[tensor\[2, 8\], tensor\[2, 8\]\], "
                                         r"captured as one value \(x\)"):
        captured.flatten_inputs(([x, x],), "step")


def test_the_pytree_detail_follows_the_sentence(exported_mlp: tuple[Captured, torch.Tensor]) -> None:
    captured, x = exported_mlp
    message = _refused(captured, (x, x))
    sentence, detail = message.split(" (pytree structures: ", 1)
    assert "TreeSpec" not in sentence
    assert detail.startswith("got TreeSpec(") and ", captured TreeSpec(" in detail


def test_symbolic_trace_inputs_by_position_or_keyword() -> None:
    model, (x,), _, _ = mlp.build(batch_size=2, width=8, depth=2)
    captured = capture(model, (x,), method=CaptureMethod.SYMBOLIC_TRACE)
    assert captured.flatten_inputs({"x": x}, "step") == [x]  # a keyword is fine on this path
    takes = r"the plan was captured with 1 input \(x\), by position or keyword"
    with pytest.raises(InputError, match=rf"^step got 2 positional inputs \(tensor\[2, 8\], tensor\[2, 8\]\); "
                                         rf"{takes}: 2 positional inputs, at most 1$"):
        captured.flatten_inputs((x, x), "step")
    with pytest.raises(InputError, match=rf"^step got 1 keyword input \(y=tensor\[2, 8\]\); {takes}: "
                                         r"unknown input\(s\) \['y'\]$"):
        captured.flatten_inputs({"y": x}, "step")
    with pytest.raises(InputError, match=rf"^step got no inputs; {takes}: no value for \['x'\], which have no default$"):
        captured.flatten_inputs((), "step")
    with pytest.raises(InputError, match=r"^step inputs must be a tuple of positional tensors or a dict"):
        captured.flatten_inputs(x, "step")  # type: ignore[arg-type]
