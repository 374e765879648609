"""Values a stage computes again instead of receiving: cuts carry only what must cross.

A causal mask (``[1, 1, S, S]`` bool) or a rotary table is a parameter-free function of the
model inputs and buffers, both of which every stage already has (the batch is given to every
rank; buffers are copied into every stage that reads them). Sent, the mask grows with the
square of the sequence: 64 MiB per microbatch and cut at 8k tokens, 1 GiB at 32k. Computed
again on the receiving stage it costs a few memory-bound kernels.

:func:`mark_rebuilt` decides, value by value, on the cost table: a value read by a node that is
not itself rebuildable is rebuilt where computing it (and what it is computed from) takes less
time than sending it over ``link``; the plan records the choice (``NodeCost.rebuilt``), every
liveness of the plan then leaves those values off every cut
(:func:`pipecut.passes.partition.chain.liveness`), and the stage split copies them into each
stage that reads them (:func:`pipecut.passes.rewrite.split.split_stage`).

A node is rebuildable when all of these hold:

- it is a function or method call (a module call may hold state or draw random numbers);
- it reads no parameter, and every input is a model input, a buffer or a rebuildable node;
- no tensor it returns requires a gradient (nothing flows back through it);
- it draws no random numbers (dropout, ``rand*``, ``bernoulli``, ``normal`` ...);
- no node writes it in place (a stage that received it would see the write; a rebuilt copy
  would not), and it is not itself an in-place op.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from pipecut.cluster import Link
from pipecut.core.cut_values import leaf_bytes
from pipecut.core.kinds import LeafKind, NodeOp
from pipecut.ir import NodeCost

__all__ = ["mark_rebuilt", "rebuildable"]

_CALLS = (NodeOp.CALL_FUNCTION, NodeOp.CALL_METHOD)
_RANDOM = re.compile(r"dropout|^rand|bernoulli|normal|uniform|multinomial|exponential|poisson|cauchy|geometric")


def _parts(target: str) -> list[str]:
    return [p for p in re.split(r"[.:]+", target) if p]


def _random(target: str) -> bool:
    return any(_RANDOM.search(p) for p in _parts(target))


def _in_place(target: str) -> bool:
    """``add_``, ``aten.masked_fill_.Scalar``, ``copy_``: an op that writes its first input."""
    return any(p.endswith("_") and not p.startswith("_") for p in _parts(target))


def _needs_grad(node: NodeCost) -> bool:
    return any(leaf.kind is LeafKind.TENSOR and leaf.requires_grad for leaf in node.leaves)


def rebuildable(nodes: Sequence[NodeCost]) -> frozenset[str]:
    """Names of the nodes every stage could compute for itself (the rules of the module doc)."""
    by_name = {n.name: n for n in nodes}
    written = {src for n in nodes if _in_place(n.target) for src in n.inputs[:1]}
    local: set[str] = set()
    for n in nodes:  # topological order: inputs are decided first
        if n.op not in _CALLS or n.parameters or n.param_bytes or n.name in written:
            continue
        if _random(n.target) or _in_place(n.target) or _needs_grad(n):
            continue
        if all(_available(by_name.get(src), local) for src in n.inputs):
            local.add(n.name)
    return frozenset(local)


def _available(src: NodeCost | None, local: set[str]) -> bool:
    if src is None:
        return False
    if src.op is NodeOp.PLACEHOLDER:
        return True
    if src.op is NodeOp.GET_ATTR:
        return src.param_bytes == 0 and not src.parameters  # a buffer, not a parameter
    return src.name in local


def _closure(name: str, by_name: dict[str, NodeCost], local: frozenset[str]) -> set[str]:
    out: set[str] = set()
    todo = [name]
    while todo:
        n = todo.pop()
        if n in out or n not in local:
            continue
        out.add(n)
        todo.extend(by_name[n].inputs)
    return out


def _send_ms(node: NodeCost, link: Link) -> float:
    tensors = [leaf for leaf in node.leaves if leaf.kind is LeafKind.TENSOR]
    return link.transfer_ms(sum(leaf_bytes(leaf) for leaf in tensors), len(tensors))


def mark_rebuilt(nodes: Sequence[NodeCost], link: Link) -> tuple[NodeCost, ...]:
    """The cost table with ``rebuilt`` set where rebuilding a value beats sending it over
    ``link`` (new rows; ``nodes`` is not changed). A value is weighed where a node that cannot
    rebuild it reads it: its own forward and that of the rebuildable nodes it is computed from,
    against its bytes on the wire. Where several links may carry a cut, pass the fastest: a
    value rebuilt there is rebuilt for every cut."""
    by_name = {n.name: n for n in nodes}
    local = rebuildable(nodes)
    frontier = dict.fromkeys(src for n in nodes if n.name not in local for src in n.inputs if src in local)
    chosen: set[str] = set()
    for name in frontier:
        closure = _closure(name, by_name, local)
        if sum(by_name[c].forward_ms for c in closure) < _send_ms(by_name[name], link):
            chosen |= closure
    return tuple(
        n if n.rebuilt == (n.name in chosen) else dataclasses.replace(n, rebuilt=n.name in chosen)
        for n in nodes
    )
