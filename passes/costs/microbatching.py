"""How many microbatches: candidates, and node costs at any microbatch size from two measured.

The number of microbatches M moves throughput as much as the split does: more microbatches
shrink the bubble ((K - 1) / (M + K - 1) for GPipe/1F1B) but each is smaller, and small
microbatches use the hardware less well (kernel launch and per-op overheads do not shrink with
the batch). The planner therefore profiles the graph at two microbatch sizes and models every
node's time as affine in the microbatch size, ``t(b) = t0 + c * b``: the fixed part is what
makes small microbatches lose. Bytes are scaled per tensor dimension: a dimension that differs
between the two measurements scales with the microbatch (the batch, or batch * sequence after a
flatten), one that does not is fixed.

Pure numbers over cost tables; no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pipecut.core.kinds import LeafKind, ScheduleKind
from pipecut.ir import Leaf, NodeCost

__all__ = ["candidate_microbatches", "costs_at", "with_structure"]


def candidate_microbatches(
    batch_size: int, ranks: int, schedule: ScheduleKind, most: int | None = None
) -> tuple[int, ...]:
    """Divisors of the batch worth trying: at least one per rank (fewer leaves ranks idle), at
    most ``most`` (default 4 per rank: beyond that the bubble is under 20 % and per-microbatch
    overheads dominate); interleaved schedules need a multiple of the ranks."""
    most = most if most is not None else 4 * ranks
    out = [
        m for m in range(1, batch_size + 1)
        if batch_size % m == 0 and min(ranks, batch_size) <= m <= most
        and (schedule is not ScheduleKind.INTERLEAVED_1F1B or m % ranks == 0)
    ]
    return tuple(out) or (batch_size,)


def _affine(lo: float, hi: float, size_lo: int, size_hi: int, size: int) -> float:
    if size_hi == size_lo:
        return lo
    slope = (hi - lo) / (size_hi - size_lo)
    return max(0.0, lo + slope * (size - size_lo))


def _dim(lo: int, hi: int, size_lo: int, size: int) -> int:
    return lo if lo == hi else lo * size // size_lo


def _leaf(lo: Leaf, hi: Leaf, size_lo: int, size: int) -> Leaf:
    if lo.kind is not LeafKind.TENSOR or len(lo.shape) != len(hi.shape):
        return lo
    return dataclasses.replace(lo, shape=tuple(_dim(a, b, size_lo, size) for a, b in zip(lo.shape, hi.shape)))


def costs_at(
    lo: Sequence[NodeCost], hi: Sequence[NodeCost], size_lo: int, size_hi: int, size: int
) -> tuple[NodeCost, ...]:
    """The cost table at microbatch ``size`` from tables measured at ``size_lo`` and
    ``size_hi`` (same graph: rows are matched by name and must agree)."""
    if [n.name for n in lo] != [n.name for n in hi]:
        raise ValueError("cost tables of different graphs cannot be interpolated")
    out = []
    for a, b in zip(lo, hi):
        leaves = tuple(_leaf(x, y, size_lo, size) for x, y in zip(a.leaves, b.leaves))
        ratio = size / size_lo
        out.append(dataclasses.replace(
            a,
            forward_ms=_affine(a.forward_ms, b.forward_ms, size_lo, size_hi, size),
            backward_ms=_affine(a.backward_ms, b.backward_ms, size_lo, size_hi, size),
            output_bytes=a.output_bytes if a.output_bytes == b.output_bytes else int(a.output_bytes * ratio),
            saved_bytes=None if a.saved_bytes is None or b.saved_bytes is None
            else round(_affine(a.saved_bytes, b.saved_bytes, size_lo, size_hi, size)),
            leaves=leaves,
            shape=next((x.shape for x in leaves if x.kind is LeafKind.TENSOR), a.shape),
        ))
    return tuple(out)


def with_structure(timed: Sequence[NodeCost], described: Sequence[NodeCost]) -> tuple[NodeCost, ...]:
    """``timed``'s costs on ``described``'s values: the output leaves, shapes and dtypes of the
    graph run (on fake tensors) at the size planned for. Interpolated rows (:func:`costs_at`) scale tensor
    dimensions, but a Python number that crosses a cut (``x.size(0)``, a sequence length times
    the microbatch) keeps the measured size's value, which the stages would then be built with."""
    by_name = {n.name: n for n in described}
    out = []
    for row in timed:
        d = by_name.get(row.name)
        if d is None:
            raise ValueError(f"node {row.name} is not in the described graph: tables of different graphs")
        out.append(dataclasses.replace(row, leaves=d.leaves, shape=d.shape, dtype=d.dtype, treespec=d.treespec))
    return tuple(out)

