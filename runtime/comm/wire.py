"""Point-to-point transfers between neighbouring stages, shaped by the plan.

Every value crossing a cut is pytree-flattened; its tensor leaves go over the wire with the
shape and dtype of a :class:`WireSpec` (so receivers allocate without a handshake), its
constant leaves come from the spec. The spec is the plan's for the planned input shapes; for
other shapes or under autocast it is derived on every rank alike from the microbatch's input
shapes and autocast state (see ``pipecut.core.shapes``), never exchanged. Both ends check every
tensor against it (:func:`pack` before sending, :func:`unpack` after receiving), so a rank that
disagrees fails with the value, both dtypes and shapes, instead of reinterpreting bytes.
Messages are matched by order, as NCCL does (per pair of ranks, the n-th send meets the n-th
receive): :mod:`pipecut.runtime.comm.p2p` fixes that order and :mod:`pipecut.runtime.comm.nccl` proves
it safe. Each message still carries a unique tag, which gloo checks and NCCL ignores; nothing
depends on it. Every wait has a deadline.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecut.core.cut_values import decode_constant, dtype_from_name, encode_constant, flatten
from pipecut.core.kinds import LeafKind
from pipecut.core.torch_private import pytree
from pipecut.errors import PipelineRuntimeError
from pipecut.ir import NodeCost
from pipecut.runtime.comm.p2p import Direction, Transfer

__all__ = ["Peer", "TensorLeaf", "WireSpec", "pack", "tag", "unpack"]

_LEAF_BITS, _CUT_BITS, _MB_BITS = 10, 8, 12  # gloo tags are 31-bit


def tag(cut: int, microbatch: int, direction: int, leaf: int) -> int:
    """A unique tag per message of a step: cut (between stage cut-1 and cut), microbatch,
    direction and leaf. Raises when a plan is too large to tag (never silently aliases)."""
    if cut >= 1 << _CUT_BITS or microbatch >= 1 << _MB_BITS or leaf >= 1 << _LEAF_BITS:
        raise PipelineRuntimeError(
            f"cannot tag message (cut {cut}, microbatch {microbatch}, leaf {leaf}): at most "
            f"{1 << _CUT_BITS} stages, {1 << _MB_BITS} microbatches and {1 << _LEAF_BITS} "
            f"tensors per cut"
        )
    return (((microbatch << 1 | direction) << _CUT_BITS | cut) << _LEAF_BITS) | leaf


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    value: int
    """Index of the value in the cut."""
    leaf: int
    """Index of the leaf in the value's flattened leaves."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True, slots=True)
class WireSpec:
    """How the values of one cut travel: their tensor leaves, in wire order (computed once)."""

    values: tuple[NodeCost, ...]
    tensors: tuple[TensorLeaf, ...] = field(init=False)
    grads: tuple[TensorLeaf, ...] = field(init=False)
    """The tensor leaves whose gradients travel back."""
    structures: tuple[Any, ...] = field(init=False)
    """Per value: its pytree structure and its leaves, constants decoded, tensors as None."""

    def __post_init__(self) -> None:
        tensors = tuple(
            TensorLeaf(value=v, leaf=i, shape=leaf.shape, dtype=dtype_from_name(leaf.dtype),
                       requires_grad=leaf.requires_grad)
            for v, node in enumerate(self.values)
            for i, leaf in enumerate(node.leaves)
            if leaf.kind is LeafKind.TENSOR
        )
        object.__setattr__(self, "tensors", tensors)
        object.__setattr__(self, "grads", tuple(t for t in tensors if t.requires_grad))
        object.__setattr__(self, "structures", tuple(
            (
                None if node.treespec is None else pytree.treespec_loads(node.treespec),
                tuple(None if leaf.kind is LeafKind.TENSOR else decode_constant(leaf.value) for leaf in node.leaves),
            )
            for node in self.values
        ))


class Peer:
    """Sends to and receives from one neighbouring rank, with deadlines."""

    def __init__(
        self, group: dist.ProcessGroup | None, rank: int, cut: int, timeout: datetime.timedelta, me: int
    ) -> None:
        self.group = group
        self.rank = rank
        self.cut = cut
        """The cut this peer is across: between stage ``cut - 1`` and stage ``cut``."""
        self.timeout = timeout
        self.me = me

    def send_op(self, tensor: torch.Tensor, t: Transfer) -> dist.P2POp:
        return dist.P2POp(dist.isend, tensor, self.rank, group=self.group, tag=self._tag(t))

    def recv_op(self, buffer: torch.Tensor, t: Transfer) -> dist.P2POp:
        return dist.P2POp(dist.irecv, buffer, self.rank, group=self.group, tag=self._tag(t))

    def _tag(self, t: Transfer) -> int:
        return tag(self.cut, t.microbatch, 0 if t.direction is Direction.FORWARD else 1, t.leaf)


def _mismatch(stage: int | None, where: str, node: str, leaf: int, got: str, expected: str) -> PipelineRuntimeError:
    at = f"stage {stage}" if stage is not None else "a stage"
    return PipelineRuntimeError(
        f"{at} {where} value {node} (tensor leaf {leaf}) as {got}, but the wire spec for this "
        f"microbatch's input shapes and autocast state has {expected}. Every rank must run "
        f"step() with the same batch under the same torch.autocast state; if they do, the "
        f"stage computes other dtypes/shapes than propagation predicted: re-plan"
    )


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"


def pack(values: Sequence[Any], spec: WireSpec, stage: int) -> list[torch.Tensor]:
    """Tensor leaves of the values to send, after checking every tensor's shape and dtype and
    every constant against the spec."""
    tensors = []
    for value, node in zip(values, spec.values):
        leaves = flatten(value)
        if len(leaves) != len(node.leaves):
            raise PipelineRuntimeError(
                f"stage {stage}: value {node.name} has {len(leaves)} leaves, the plan has "
                f"{len(node.leaves)}; re-plan for these inputs"
            )
        for i, (leaf, planned) in enumerate(zip(leaves, node.leaves)):
            if planned.kind is LeafKind.TENSOR:
                expected = f"{planned.dtype} {list(planned.shape)}"
                if not isinstance(leaf, torch.Tensor):
                    raise _mismatch(stage, "sends", node.name, i, type(leaf).__name__, expected)
                if tuple(leaf.shape) != planned.shape or leaf.dtype != dtype_from_name(planned.dtype):
                    raise _mismatch(stage, "sends", node.name, i, _describe(leaf), expected)
                tensors.append(leaf)
            elif encode_constant(leaf) != planned.value:
                raise PipelineRuntimeError(
                    f"stage {stage}: value {node.name} is {leaf!r}, the wire spec fixed it to "
                    f"{decode_constant(planned.value)!r} for this microbatch's input shapes; "
                    f"re-plan for these inputs"
                )
    return tensors


def unpack(tensors: Sequence[torch.Tensor], spec: WireSpec, stage: int | None = None) -> list[Any]:
    """Rebuild the values of a cut from received tensor leaves and the spec's constants, after
    checking the received tensors are the spec's (count, dtype and shape)."""
    if len(tensors) != len(spec.tensors):
        raise PipelineRuntimeError(
            f"stage {stage} received {len(tensors)} tensors, the wire spec has {len(spec.tensors)} "
            f"({', '.join(n.name for n in spec.values)})"
        )
    for t, leaf in zip(tensors, spec.tensors):
        if tuple(t.shape) != leaf.shape or t.dtype != leaf.dtype:
            expected = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)}"
            raise _mismatch(stage, "received", spec.values[leaf.value].name, leaf.leaf, _describe(t), expected)
    it = iter(tensors)
    values = []
    for node, (structure, constants) in zip(spec.values, spec.structures):
        if structure is None:
            raise PipelineRuntimeError(f"value {node.name} has no serializable structure; it cannot cross a cut")
        leaves = [next(it) if leaf.kind is LeafKind.TENSOR else c for leaf, c in zip(node.leaves, constants)]
        values.append(pytree.tree_unflatten(leaves, structure))
    return values
