"""pipecut.core.program: how user inputs map onto a captured graph's placeholders."""

from __future__ import annotations

import pytest
import torch
from torch import fx, nn

from pipecut.core.kinds import CaptureMethod
from pipecut.core.program import NO_DEFAULT, Captured, split_args
from pipecut.errors import InputError


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
    takes = r"the plan was captured with 3 inputs \(x, mask, extra\), by position or keyword"
    with pytest.raises(InputError, match=rf"inputs got 3 keyword inputs \(x=int, mask=int, y=int\); {takes}: "
                                         r"unknown input\(s\) \['y'\]"):
        c.flatten_inputs({"x": 1, "mask": 2, "y": 3})
    with pytest.raises(InputError, match=r"no value for \['mask'\], which have no default"):
        c.flatten_inputs({"x": 1})
    with pytest.raises(InputError, match=r"no value for \['mask'\], which have no default"):
        c.flatten_inputs((1,))
    with pytest.raises(InputError, match="4 positional inputs, at most 3"):
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
    with pytest.raises(InputError, match=r"got 1 keyword input \(a=int\); the plan was captured with 2 "
                                         r"keyword inputs \(b, a\): missing keyword\(s\) \['b'\]"):
        c.flatten_inputs({"a": 1})
    with pytest.raises(InputError, match=r"got 2 positional inputs \(int, int\); .*: pass them as keywords"):
        c.flatten_inputs((1, 2))
    assert c.unflatten_output([5, 6]) == {"loss": 5, "logits": 6}
    assert fx_captured().unflatten_output([5, 6]) == [5, 6]


def test_split_args():
    assert split_args((1, 2)) == ((1, 2), {})
    assert split_args({"a": 1}) == ((), {"a": 1})
    assert repr(NO_DEFAULT) == "<no default>"
