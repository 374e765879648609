"""Values that cross stage boundaries: pytree-flattened into tensors and constants.

A node's output may be a tensor, a tuple of tensors, a ``torch.Size`` or a plain number. The
plan stores, per node, the pytree structure and one :class:`~pipecut.ir.Leaf` per leaf.
Tensor leaves travel over the wire with the shape and dtype the plan gives (no handshake).
Non-tensor leaves (sizes, ints derived from shapes) are fixed by the planned input shapes, so
the plan stores their value and the receiving stage uses it; the sending stage checks that the
value it computed is still the planned one, so a drift is an error, never a silent mismatch.
"""

from __future__ import annotations

from typing import Any

import torch

from pipecut.core.kinds import LeafKind
from pipecut.core.torch_private import pytree
from pipecut.ir import Leaf

__all__ = [
    "decode_constant",
    "describe",
    "dtype_from_name",
    "dtype_name",
    "encode_constant",
    "flatten",
    "leaf_bytes",
    "tensor_bytes",
]

_SCALARS = (bool, int, float, str, type(None))


def encode_constant(value: Any) -> Any:
    """JSON encoding of a non-tensor leaf, or None when it cannot be encoded."""
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and value != value:  # NaN is not JSON
            return {"t": "float", "v": "nan"}
        return {"t": type(value).__name__, "v": value}
    if isinstance(value, torch.dtype):
        return {"t": "dtype", "v": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"t": "device", "v": str(value)}
    if isinstance(value, slice):
        parts = [encode_constant(x) for x in (value.start, value.stop, value.step)]
        return None if any(p is None for p in parts) else {"t": "slice", "v": parts}
    if value is Ellipsis:
        return {"t": "ellipsis", "v": None}
    return None


def decode_constant(data: Any) -> Any:
    kind, v = data["t"], data["v"]
    if kind == "float":
        return float(v)
    if kind in ("bool", "int", "str", "NoneType"):
        return v
    if kind == "dtype":
        return getattr(torch, v)
    if kind == "device":
        return torch.device(v)
    if kind == "slice":
        return slice(*(decode_constant(p) for p in v))
    if kind == "ellipsis":
        return Ellipsis
    raise ValueError(f"unknown constant kind {kind!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def describe(value: Any) -> tuple[tuple[Leaf, ...], str | None]:
    """Leaves and serialized pytree structure of a node's output."""
    leaves, spec = pytree.tree_flatten(value)
    try:
        treespec: str | None = pytree.treespec_dumps(spec)
    except Exception:
        treespec = None  # a container type pytree cannot serialize: such a value cannot be cut
    out = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            out.append(
                Leaf(
                    kind=LeafKind.TENSOR,
                    shape=tuple(leaf.shape),
                    dtype=dtype_name(leaf.dtype),
                    requires_grad=leaf.requires_grad,
                )
            )
        else:
            out.append(Leaf(kind=LeafKind.CONSTANT, value=encode_constant(leaf)))
    return tuple(out), treespec


def tensor_bytes(value: Any) -> int:
    """Bytes of every distinct tensor in a (possibly nested) value."""
    seen: set[int] = set()
    total = 0
    for leaf in pytree.tree_leaves(value):
        if isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
            seen.add(id(leaf))
            total += leaf.numel() * leaf.element_size()
    return total


def leaf_bytes(leaf: Leaf) -> int:
    if leaf.kind is not LeafKind.TENSOR:
        return 0
    numel = 1
    for d in leaf.shape:
        numel *= d
    return numel * dtype_from_name(leaf.dtype).itemsize


def flatten(value: Any) -> list[Any]:
    return pytree.tree_leaves(value)
