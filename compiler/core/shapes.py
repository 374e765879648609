"""The shapes a plan accepts at run time, and the signature that keys a microbatch's wire specs.

A plan is made for one batch shape, but a training loop sees shorter sequences and a smaller
last batch. Instead of a shape handshake between ranks (a source of hangs in other tools),
every rank derives the same :class:`Signature` from the batch it is given (all ranks of a
pipeline get the same batch) and the autocast state it runs under; the wire spec of every cut
value is a deterministic function of that signature (``pipecut.passes.rewrite.propagate``). This module
holds the plain data and checks; it imports no pass and no runtime.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from pipecut.core.cut_values import dtype_name, encode_constant
from pipecut.core.kinds import LeafKind, ScheduleKind
from pipecut.core.torch_private import pytree
from pipecut.errors import InputError
from pipecut.ir import InputShape, Plan

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class AutocastState:
    """The autocast state that decides cut dtypes: off, or on with a dtype, per device type."""

    device_type: str
    enabled: bool
    dtype: str

    def __str__(self) -> str:
        return f"autocast {self.device_type} {self.dtype}" if self.enabled else "no autocast"

    @classmethod
    def current(cls, device_type: str) -> AutocastState:
        """Autocast as it is now for ``device_type``; every "off" is the same state."""
        if not torch.is_autocast_enabled(device_type):
            return cls("", False, "")
        return cls(device_type, True, dtype_name(torch.get_autocast_dtype(device_type)))


@dataclass(frozen=True, slots=True)
class Signature:
    """What the wire specs of one microbatch depend on: each flat input's shape and dtype
    (tensors) or JSON value (constants), and the autocast state. Hashable: specs are cached
    per signature."""

    inputs: tuple[tuple[tuple[int, ...], str] | str, ...]
    autocast: AutocastState


def token_dim(ndim: int) -> int:
    """Where sequence parallelism cuts a value of ``ndim`` dimensions: its tokens, ``ndim - 2``
    (``(batch, tokens, features)``, ``(tokens, features)``); 0 for a vector. One rule for the
    regions that cut it, the wire that carries its shards and the planner that prices them."""
    return max(ndim - 2, 0)


def signature(flat: Sequence[Any], autocast: AutocastState) -> Signature:
    """The signature of one microbatch's flat placeholder values."""
    parts: list[tuple[tuple[int, ...], str] | str] = []
    for value in flat:
        if isinstance(value, torch.Tensor):
            parts.append((tuple(value.shape), dtype_name(value.dtype)))
        else:
            parts.append(json.dumps([encode_constant(x) for x in pytree.tree_leaves(value)], sort_keys=True))
    return Signature(tuple(parts), autocast)


def planned_signature(plan: Plan) -> Signature:
    """The signature of the planned microbatch without autocast: the plan's own leaves apply."""
    parts: list[tuple[tuple[int, ...], str] | str] = []
    for name in plan.inputs:
        leaves = plan.node(name).leaves
        if len(leaves) == 1 and leaves[0].kind is LeafKind.TENSOR:
            parts.append((leaves[0].shape, leaves[0].dtype))
        else:
            parts.append(json.dumps([leaf.value for leaf in leaves], sort_keys=True))
    return Signature(tuple(parts), AutocastState("", False, ""))


def accepted(plan: Plan) -> tuple[InputShape, ...]:
    """The plan's accepted input shapes; for plans made before they were recorded, exactly the
    planned shapes (what those plans were guaranteed for)."""
    if plan.accepts:
        return plan.accepts
    out = []
    for name in plan.inputs:
        leaves = plan.node(name).leaves
        if len(leaves) == 1 and leaves[0].kind is LeafKind.TENSOR:
            shape = leaves[0].shape
            out.append(InputShape(name=name, dtype=leaves[0].dtype, min_shape=shape, max_shape=shape))
    return tuple(out)


def describe_accepted(shapes: Sequence[InputShape]) -> str:
    """``input_ids: int64 [2..4, 8..16]`` per input, for error messages."""

    def dim(lo: int, hi: int) -> str:
        return str(hi) if lo == hi else f"{lo}..{hi}"

    return "; ".join(
        f"{s.name}: {s.dtype} [{', '.join(dim(lo, hi) for lo, hi in zip(s.min_shape, s.max_shape))}]"
        for s in shapes
    )


def _refuse(plan: Plan, what: str) -> InputError:
    return InputError(
        f"{what}. This plan accepts microbatches of {describe_accepted(accepted(plan))} "
        f"(batch up to {plan.batch_size} in {plan.microbatches} microbatches); pass inputs "
        f"within these shapes or re-plan with example inputs of the largest shape you will use"
    )


def check_microbatch(plan: Plan, names: Sequence[str], values: Sequence[Any]) -> None:
    """Raise :class:`InputError` unless every tensor input is within the plan's accepted shapes."""
    by_name = dict(zip(names, values))
    symbols: dict[str, tuple[int, str]] = {}
    for spec in accepted(plan):
        value = by_name.get(spec.name)
        if not isinstance(value, torch.Tensor):
            raise _refuse(plan, f"input {spec.name!r} is {type(value).__name__}, the plan has a tensor")
        shape = tuple(value.shape)
        if dtype_name(value.dtype) != spec.dtype:
            raise _refuse(plan, f"input {spec.name!r} has dtype {dtype_name(value.dtype)}, the plan has {spec.dtype}")
        if len(shape) != len(spec.max_shape) or any(
            not lo <= d <= hi for d, lo, hi in zip(shape, spec.min_shape, spec.max_shape)
        ):
            raise _refuse(plan, f"input {spec.name!r} has microbatch shape {shape}")
        for d, sym in zip(shape, spec.symbols):
            if sym and symbols.setdefault(sym, (d, spec.name))[0] != d:
                other = symbols[sym]
                raise _refuse(
                    plan, f"input {spec.name!r} has size {d} where {other[1]!r} has {other[0]}; "
                    f"the captured graph assumes they are equal"
                )


def microbatch_sizes(batch: int, plan: Plan) -> tuple[int, ...]:
    """How a batch of ``batch`` splits: the plan's M equal microbatches when it can; for a
    smaller batch, M microbatches as equal as possible (sizes differ by at most one), or fewer
    when there are fewer samples than M (a multiple of the ranks for interleaved schedules with
    several stages per rank),
    each within the plan's accepted microbatch sizes."""
    m = plan.microbatches
    hi = plan.batch_size // m
    lo = max((s.min_shape[0] for s in accepted(plan) if s.min_shape), default=hi)  # every input's
    if batch > plan.batch_size:
        raise _refuse(plan, f"the batch has {batch} samples, more than the planned {plan.batch_size}")
    n = min(m, batch // lo) if lo > 0 else m
    if plan.schedule is ScheduleKind.INTERLEAVED_1F1B and plan.stages_per_rank > 1:
        n -= n % plan.num_ranks  # one stage per rank is plain 1F1B: any count runs
    if n < 1 or -(-batch // n) > hi:
        raise _refuse(
            plan, f"a batch of {batch} does not split into at most {m} microbatches of "
            f"{lo}..{hi} samples"
        )
    return tuple(batch // n + (1 if i < batch % n else 0) for i in range(n))


def loss_weights(sizes: Sequence[int]) -> tuple[Fraction, ...]:
    """Microbatch i's loss is scaled by ``sizes[i] / sum(sizes)`` (an exact, reduced fraction),
    so the sum of weighted mean losses is the whole batch's mean loss even when microbatches
    differ in size. With equal microbatches this is exactly the former ``loss / M``."""
    total = sum(sizes)
    return tuple(Fraction(s, total) for s in sizes)


