"""pipecut.core.cut_values: how values crossing stages are described, encoded and sized."""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._pytree as pytree

from pipecut.core.cut_values import (
    decode_constant,
    describe,
    dtype_from_name,
    dtype_name,
    encode_constant,
    flatten,
    leaf_bytes,
    tensor_bytes,
)
from pipecut.core.kinds import LeafKind
from pipecut.ir import Leaf


@pytest.mark.parametrize("value", [True, 3, -2.5, "x", None, torch.float16, torch.device("cpu"),
                                   slice(1, None, 2), Ellipsis])
def test_constants_round_trip(value):
    encoded = encode_constant(value)
    assert encoded is not None
    decoded = decode_constant(encoded)
    assert decoded == value and type(decoded) is type(value)


def test_nan_is_encoded_as_json_safe_text():
    encoded = encode_constant(float("nan"))
    assert encoded == {"t": "float", "v": "nan"}
    assert math.isnan(decode_constant(encoded))


def test_what_cannot_be_encoded_is_none():
    assert encode_constant(object()) is None
    assert encode_constant(slice(object(), 2)) is None  # one part cannot be encoded


def test_unknown_constant_kind_is_refused():
    with pytest.raises(ValueError, match="unknown constant kind 'tuple'"):
        decode_constant({"t": "tuple", "v": []})


def test_dtype_names_round_trip_and_unknown_is_refused():
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        assert dtype_from_name(dtype_name(dtype)) is dtype
    assert dtype_name(torch.float32) == "float32"
    with pytest.raises(ValueError, match="unknown dtype 'float17'"):
        dtype_from_name("float17")
    with pytest.raises(ValueError, match="unknown dtype 'nn'"):
        dtype_from_name("nn")  # an attribute of torch, but not a dtype


def test_describe_gives_a_leaf_per_pytree_leaf_and_a_loadable_spec():
    a = torch.zeros(2, 3, requires_grad=True)
    value = (a, torch.ones(4, dtype=torch.int64), torch.Size([2, 3])[0])
    leaves, spec = describe(value)
    assert leaves == (
        Leaf(kind=LeafKind.TENSOR, shape=(2, 3), dtype="float32", requires_grad=True),
        Leaf(kind=LeafKind.TENSOR, shape=(4,), dtype="int64", requires_grad=False),
        Leaf(kind=LeafKind.CONSTANT, value={"t": "int", "v": 2}),
    )
    assert spec is not None
    rebuilt = pytree.tree_unflatten(flatten(value), pytree.treespec_loads(spec))
    assert rebuilt[2] == 2 and rebuilt[0] is a


def test_leaf_bytes_is_numel_times_itemsize_and_zero_for_constants():
    assert leaf_bytes(Leaf(kind=LeafKind.TENSOR, shape=(4, 8), dtype="float16")) == 64
    assert leaf_bytes(Leaf(kind=LeafKind.TENSOR, shape=(), dtype="float64")) == 8
    assert leaf_bytes(Leaf(kind=LeafKind.CONSTANT, value={"t": "int", "v": 7})) == 0
    leaves, _ = describe((torch.zeros(3, 5), 1))
    assert [leaf_bytes(x) for x in leaves] == [60, 0]


def test_tensor_bytes_counts_each_tensor_once():
    t = torch.zeros(10)  # 40 bytes
    assert tensor_bytes((t, [t, {"k": torch.zeros(2, dtype=torch.int8)}], 3)) == 42
    assert tensor_bytes(5) == 0
