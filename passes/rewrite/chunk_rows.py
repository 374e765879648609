"""Compute a heavy linear-like node in row pieces, so that its pieces can sit on different stages.

A 32k-vocabulary LM head is one node costing two or three transformer blocks: every split's
slowest stage is at least that node. Its rows (the tokens, dim -2 of its first operand) are
independent: ``linear(x, W)[..., i, :] == linear(x[..., i, :], W)``. This pass rewrites each
named node as ``pieces`` row chunks of that operand, the same op on each (the weight used whole:
no parameter is sliced, so tied weights keep working), and one ``torch.cat(..., dim=-2)``
that takes the original node's name, so every reader of the node is unchanged::

    lm_head                      lm_head_rows0 = row_chunk(x, 0, 2)   lm_head_rows1 = row_chunk(x, 1, 2)
      = linear(x, W)      ->     lm_head_piece0 = linear(lm_head_rows0, W)
                                 lm_head_piece1 = linear(lm_head_rows1, W)
                                 lm_head = torch.cat([lm_head_piece0, lm_head_piece1], dim=-2)

The names are fixed by the node's name and the piece index, so the runtime, applying the pass
again from ``plan.chunked``, gets the very graph the plan was made on. The input graph is never
modified: the result is a new GraphModule over the same parameters.

    >>> chunked = chunk_rows(captured.gm, (ChunkedNode(node="lm_head", pieces=4),))
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from pipecut.core.graph import attr_tensor
from pipecut.errors import PlanError
from pipecut.ir import ChunkedNode

__all__ = ["chunk_rows", "chunkable", "piece_names", "row_chunk"]

_aten = torch.ops.aten
_LINEAR = (F.linear, _aten.linear.default)
_MATMUL = (torch.matmul, operator.matmul, _aten.matmul.default, _aten.mm.default)
_SHAPE_META = ("val", "tensor_meta")  # what torch.export records per node; not true of a piece


def row_chunk(x: torch.Tensor, index: int, pieces: int) -> torch.Tensor:
    """Chunk ``index`` of ``pieces`` near-equal chunks of ``x`` along dim -2 (a view; the first
    ``rows % pieces`` chunks are one row longer, as ``torch.tensor_split`` gives them)."""
    return x.tensor_split(pieces, dim=-2)[index]


def piece_names(node: str, pieces: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The names of the row chunks and of the pieces that replace ``node``."""
    return (tuple(f"{node}_rows{i}" for i in range(pieces)), tuple(f"{node}_piece{i}" for i in range(pieces)))


def _ndim(value: Any, gm: fx.GraphModule) -> int | None:
    """Dimensions of a node's value where the graph tells them (export's meta, a parameter)."""
    if not isinstance(value, fx.Node):
        return value.dim() if isinstance(value, torch.Tensor) else None
    for key in _SHAPE_META:
        meta = value.meta.get(key)
        if meta is not None and hasattr(meta, "shape"):
            return len(meta.shape)
    if value.op == "get_attr":
        t = attr_tensor(value, gm)
        return None if t is None else t.dim()
    if value.op == "call_method" and value.target in ("t", "transpose", "mT") and value.args:
        return _ndim(value.args[0], gm)  # a weight transposed: as many dimensions as the weight
    if value.op == "call_function" and value.target in (torch.t, _aten.t.default, _aten.transpose.int):
        return _ndim(value.args[0], gm)
    return None


def chunkable(node: fx.Node, gm: fx.GraphModule) -> str | None:
    """None if ``node`` can be computed in row pieces, else why not (for the error)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, torch.nn.Linear):
            return f"it calls a {type(module).__name__}, not an nn.Linear"
        if type(module).forward is not torch.nn.Linear.forward:  # a subclass may mix its rows
            return f"it calls a {type(module).__name__}, whose forward is not nn.Linear's"
        if node.kwargs or len(node.args) != 1:
            return "it calls its nn.Linear with other than one positional input"
    elif node.op == "call_function" and node.target in _LINEAR + _MATMUL:
        if "input" in node.kwargs or not node.args:
            return "its operand to chunk is passed by keyword"
        if node.target in _MATMUL:
            other = node.args[1] if len(node.args) > 1 else node.kwargs.get("other")
            dims = _ndim(other, gm)
            if dims is None or dims < 2:
                return ("its second operand is not known to be a matrix (a vector would drop "
                        "the row dimension)")
    else:
        return (f"its target {node.target} is not a linear-like op (nn.Linear, F.linear, "
                f"torch.matmul, @, aten.linear, aten.matmul)")
    first = node.args[0]
    if not isinstance(first, fx.Node):
        return "its first operand is not a tensor of the graph"
    dims = _ndim(first, gm)
    if dims is not None and dims < 2:
        return f"its first operand has {dims} dimension(s); rows are dim -2"
    return None


def chunk_rows(gm: fx.GraphModule, chunks: Sequence[ChunkedNode]) -> fx.GraphModule:
    """A new GraphModule where each node in ``chunks`` is computed in ``pieces`` row chunks and
    concatenated back (see the module docstring). ``gm`` is left as it was; the result shares
    its parameters and buffers. Raises PlanError naming a node that is absent, named twice, or
    not chunkable, or a piece name the graph already uses."""
    wanted = {c.node: c.pieces for c in chunks}
    if len(wanted) != len(chunks):
        raise PlanError(f"chunked nodes {[c.node for c in chunks]} name a node twice")
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, pieces in wanted.items():
        if name not in nodes:
            raise PlanError(
                f"cannot chunk node {name!r}: the graph has no such node; the plan was made for "
                f"another graph: re-plan"
            )
        why = chunkable(nodes[name], gm)
        if why is not None:
            raise PlanError(f"cannot compute node {name!r} in row pieces: {why}; plan without chunk_heavy")
        taken = [p for group in piece_names(name, pieces) for p in group if p in nodes]
        if taken:
            raise PlanError(f"cannot chunk node {name!r}: the graph already has nodes named {taken[:3]}")
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # export's: takes and returns pytrees (never mutated)
    env: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.name not in wanted:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        env[node] = _pieces(graph, node, wanted[node.name], env)
    graph.lint()
    return fx.GraphModule(gm, graph, gm.__class__.__name__)


def _pieces(graph: fx.Graph, node: fx.Node, pieces: int, env: dict[fx.Node, fx.Node]) -> fx.Node:
    """Emit the row chunks, the pieces and the concatenation that replace ``node``."""
    args = fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
    assert isinstance(args, tuple) and isinstance(kwargs, dict)
    meta = {k: v for k, v in node.meta.items() if k not in _SHAPE_META}
    rows_names, piece_names_ = piece_names(node.name, pieces)
    outs = []
    for i in range(pieces):
        rows = graph.create_node("call_function", row_chunk, (args[0], i, pieces), {}, name=rows_names[i])
        piece = graph.create_node(node.op, node.target, (rows, *args[1:]), dict(kwargs), name=piece_names_[i])
        rows.meta.update(meta)
        piece.meta.update(meta)
        outs.append(piece)
    joined = graph.create_node("call_function", torch.cat, (outs,), {"dim": -2}, name=node.name)
    joined.meta.update(node.meta)  # the same value as the node it replaces
    assert joined.name == node.name and all(p.name == n for p, n in zip(outs, piece_names_))
    return joined
