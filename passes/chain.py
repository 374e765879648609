"""From a cost table to a chain partitioning problem, and from a split back to stage facts.

Placeholders (the batch is given to every rank) and ``get_attr`` nodes (parameters live on every
stage that reads them) are not partitioned: they are available wherever they are used. Every
other node is a *unit*, in topological order. A value produced by unit ``p`` and last read by
unit ``c`` is live across every cut ``b`` with ``p < b <= c``; it is sent stage to stage over
those cuts (relayed through stages between producer and consumer), so the communication of a
stage depends only on its two cuts and the dynamic program stays exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipecut.core.cut_values import leaf_bytes
from pipecut.plan import LeafKind, Link, NodeCost, NodeOp

__all__ = [
    "Liveness",
    "boundary_bytes",
    "boundary_ms",
    "can_cross",
    "is_unit",
    "liveness",
    "param_readers",
    "reads_params",
    "unit_param_bytes",
    "value_bytes",
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
    units = tuple(n.name for n in nodes if is_unit(n))
    index = {name: i for i, name in enumerate(units)}
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.name not in index:
            continue
        for src in n.inputs:
            if src in index:
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


def boundary_bytes(nodes: Sequence[NodeCost], live: Liveness) -> tuple[list[int], list[int], list[bool]]:
    """Per cut position 0..N: activation bytes, gradient bytes, and whether the cut is allowed."""
    n = len(live.units)
    by_name = {node.name: node for node in nodes}
    fwd = [0] * (n + 2)
    bwd = [0] * (n + 2)
    blocked = [0] * (n + 2)
    for name, last in live.last_use.items():
        p = live.index[name]
        if last <= p:
            continue
        f, b = value_bytes(by_name[name])
        # live across cuts p+1 .. last (difference arrays)
        fwd[p + 1] += f
        fwd[last + 1] -= f
        bwd[p + 1] += b
        bwd[last + 1] -= b
        if not can_cross(by_name[name]):
            blocked[p + 1] += 1
            blocked[last + 1] -= 1
    out_f, out_b, allowed = [], [], []
    acc_f = acc_b = acc_x = 0
    for b in range(n + 1):
        acc_f += fwd[b]
        acc_b += bwd[b]
        acc_x += blocked[b]
        out_f.append(acc_f)
        out_b.append(acc_b)
        allowed.append(acc_x == 0)
    return out_f, out_b, allowed


def boundary_ms(fwd: Sequence[int], bwd: Sequence[int], allowed: Sequence[bool], link: Link) -> list[float]:
    """Communication time per cut: activations forward plus gradients backward."""
    out = []
    last = len(fwd) - 1
    for b, (f, g, ok) in enumerate(zip(fwd, bwd, allowed)):
        if b in (0, last):
            out.append(0.0)
        elif not ok:
            out.append(math.inf)
        else:
            out.append(link.transfer_ms(f) + link.transfer_ms(g))
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
