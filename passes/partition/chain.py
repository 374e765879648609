"""From a cost table to a chain partitioning problem, and from a split back to stage facts.

Placeholders (the batch is given to every rank) and ``get_attr`` nodes (parameters live on every
stage that reads them) are not partitioned: they are available wherever they are used. Every
other node is a *unit*, in topological order. A value produced by unit ``p`` and last read by
unit ``c`` is live across every cut ``b`` with ``p < b <= c``; it is sent stage to stage over
those cuts (relayed through stages between producer and consumer), so the communication of a
stage depends only on its two cuts and the dynamic program stays exact. A value marked
``rebuilt`` crosses no cut: every later stage that reads it computes it again from the inputs
and buffers it has (:mod:`pipecut.passes.partition.rebuild`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pipecut.cluster import Link
from pipecut.core.cut_values import leaf_bytes
from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import NodeCost

__all__ = [
    "Liveness",
    "boundary_bytes",
    "boundary_messages",
    "boundary_ms",
    "can_cross",
    "is_unit",
    "liveness",
    "param_readers",
    "reads_params",
    "unit_param_bytes",
    "value_bytes",
    "value_messages",
]

_LOCAL = (NodeOp.PLACEHOLDER, NodeOp.GET_ATTR)


@dataclass(frozen=True, kw_only=True, slots=True)
class Liveness:
    """Which values cross which cuts."""

    units: tuple[str, ...]
    last_use: dict[str, int]
    """Produced unit name -> index of the last unit that reads it."""
    index: dict[str, int]
    """Unit name -> position in ``units``."""

    def crossing(self, b: int) -> list[str]:
        """Values live across the cut before unit ``b``, in topological order."""
        return [u for u in self.units[:b] if self.last_use.get(u, -1) >= b]


def is_unit(node: NodeCost) -> bool:
    return node.op not in _LOCAL


def liveness(nodes: Sequence[NodeCost]) -> Liveness:
    """Which values cross which cuts. A value marked ``rebuilt`` crosses none: every stage that
    reads it computes it again (:mod:`pipecut.passes.partition.rebuild`)."""
    units = tuple(n.name for n in nodes if is_unit(n))
    index = {name: i for i, name in enumerate(units)}
    rebuilt = {n.name for n in nodes if n.rebuilt}
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.name not in index:
            continue
        for src in n.inputs:
            if src in index and src not in rebuilt:
                last_use[src] = max(last_use.get(src, -1), index[n.name])
    return Liveness(units=units, last_use=last_use, index=index)


def value_bytes(node: NodeCost) -> tuple[int, int]:
    """(activation bytes, gradient bytes) of a node's value on the wire."""
    fwd = bwd = 0
    for leaf in node.leaves:
        if leaf.kind is LeafKind.TENSOR:
            size = leaf_bytes(leaf)
            fwd += size
            bwd += size if leaf.requires_grad else 0
    return fwd, bwd


def can_cross(node: NodeCost) -> bool:
    """A value can cross a cut if its structure and every non-tensor leaf are serializable."""
    if node.treespec is None or not node.cuttable:
        return False
    return all(leaf.kind is LeafKind.TENSOR or leaf.value is not None for leaf in node.leaves)


def value_messages(node: NodeCost) -> tuple[int, int]:
    """(tensors sent forward, gradients sent back) for a node's value: one message each."""
    leaves = [leaf for leaf in node.leaves if leaf.kind is LeafKind.TENSOR]
    return len(leaves), sum(1 for leaf in leaves if leaf.requires_grad)


def _across_cuts(
    nodes: Sequence[NodeCost], live: Liveness, weigh: Callable[[NodeCost], tuple[int, ...]], width: int
) -> list[list[int]]:
    """Per cut position 0..N, the sums of ``weigh(value)`` over the values live across it."""
    n = len(live.units)
    by_name = {node.name: node for node in nodes}
    diff = [[0] * (n + 2) for _ in range(width)]
    for name, last in live.last_use.items():
        p = live.index[name]
        if last <= p:
            continue
        for d, w in zip(diff, weigh(by_name[name])):  # live across cuts p+1 .. last
            d[p + 1] += w
            d[last + 1] -= w
    return [list(itertools.accumulate(d[: n + 1])) for d in diff]


def boundary_bytes(nodes: Sequence[NodeCost], live: Liveness) -> tuple[list[int], list[int], list[bool]]:
    """Per cut position 0..N: activation bytes, gradient bytes, and whether the cut is allowed."""
    fwd, bwd, blocked = _across_cuts(nodes, live, lambda v: (*value_bytes(v), int(not can_cross(v))), 3)
    return fwd, bwd, [x == 0 for x in blocked]


def boundary_messages(nodes: Sequence[NodeCost], live: Liveness) -> tuple[list[int], list[int]]:
    """Per cut position 0..N: tensors sent forward and gradients sent back, one message each."""
    fwd, bwd = _across_cuts(nodes, live, value_messages, 2)
    return fwd, bwd


def boundary_ms(
    fwd: Sequence[int], bwd: Sequence[int], allowed: Sequence[bool], link: Link,
    messages: tuple[Sequence[int], Sequence[int]] | None = None,
) -> list[float]:
    """Communication time per cut: activations forward plus gradients backward, each tensor
    one message (``messages``: the counts of :func:`boundary_messages`; one per cut if None)."""
    out = []
    last = len(fwd) - 1
    f_msgs, b_msgs = messages if messages is not None else ([1] * len(fwd), [1] * len(bwd))
    for b, (f, g, ok) in enumerate(zip(fwd, bwd, allowed)):
        if b in (0, last):
            out.append(0.0)
        elif not ok:
            out.append(math.inf)
        else:
            out.append(link.transfer_ms(f, f_msgs[b]) + link.transfer_ms(g, b_msgs[b]))
    return out


def param_readers(unit: NodeCost, by_name: Mapping[str, NodeCost]) -> list[NodeCost]:
    """The nodes whose parameters a unit uses: itself (a module's own) and the ``get_attr``
    nodes it reads (a functional call's weights, a tied weight)."""
    return [unit] + [by_name[i] for i in unit.inputs if by_name[i].op is NodeOp.GET_ATTR]


def reads_params(unit: NodeCost, by_name: Mapping[str, NodeCost]) -> bool:
    """Does the unit read a parameter, directly or through a ``get_attr``?"""
    return any(r.parameters for r in param_readers(unit, by_name))


def unit_param_bytes(unit: NodeCost, by_name: Mapping[str, NodeCost]) -> int:
    """Bytes of the parameters a unit reads (a parameter two units read counts for each)."""
    return sum(r.param_bytes for r in param_readers(unit, by_name))
