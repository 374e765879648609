"""pipecut.core.program: how user inputs map onto a captured graph's placeholders."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pipecut.core.program import NO_DEFAULT, Captured, split_args
from pipecut.errors import InputError
from pipecut.plan import CaptureMethod


def fx_captured(defaults=(NO_DEFAULT, NO_DEFAULT, None)) -> Captured:
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    return Captured(gm=gm, method=CaptureMethod.SYMBOLIC_TRACE, input_names=("x", "mask", "extra"),
                    in_spec=None, out_spec=None, defaults=defaults)


def test_positionals_and_keywords_fill_placeholders_with_defaults():
    c = fx_captured()
    x, m = torch.ones(2), torch.zeros(2)
    assert c.flatten_inputs((x, m)) == [x, m, None]
    assert c.flatten_inputs({"mask": m, "x": x}) == [x, m, None]
    assert c.flatten_inputs([x, m, 3]) == [x, m, 3]


def test_unknown_missing_and_extra_inputs_are_refused():
    c = fx_captured()
    with pytest.raises(InputError, match=r"unknown input\(s\) \['y'\]; the model takes \['x', 'mask', 'extra'\]"):
        c.flatten_inputs({"x": 1, "mask": 2, "y": 3})
    with pytest.raises(InputError, match=r"input\(s\) \['mask'\] missing"):
        c.flatten_inputs({"x": 1})
    with pytest.raises(InputError, match=r"input\(s\) \['mask'\] missing"):
        c.flatten_inputs((1,))
    with pytest.raises(InputError, match="4 positional inputs but the model takes"):
        c.flatten_inputs((1, 2, 3, 4))
    with pytest.raises(InputError, match="wrap a single tensor as"):
        c.flatten_inputs(torch.ones(2))


def test_export_inputs_follow_the_traced_key_order_and_structure():
    import torch.utils._pytree as pytree

    _, in_spec = pytree.tree_flatten(((), {"b": 0, "a": 0}))
    gm = fx.GraphModule(nn.Module(), fx.Graph())
    c = Captured(gm=gm, method=CaptureMethod.EXPORT, input_names=("b", "a"), in_spec=in_spec,
                 out_spec=pytree.tree_flatten({"loss": 0, "logits": 0})[1], defaults=())
    assert c.flatten_inputs({"a": 1, "b": 2}) == [2, 1]  # traced order, not the caller's
    with pytest.raises(InputError, match=r"inputs have keys \['a'\], the plan has \['a', 'b'\]"):
        c.flatten_inputs({"a": 1})
    with pytest.raises(InputError, match="the captured graph expects"):
        c.flatten_inputs((1, 2))
    assert c.unflatten_output([5, 6]) == {"loss": 5, "logits": 6}
    assert fx_captured().unflatten_output([5, 6]) == [5, 6]


def test_split_args():
    assert split_args((1, 2)) == ((1, 2), {})
    assert split_args({"a": 1}) == ((), {"a": 1})
    assert repr(NO_DEFAULT) == "<no default>"
