"""Which heavy nodes the planner computes in row pieces, and the cost table of the result.

A node costing more than a stage's share (total / K) caps every split: the stage holding it is
at least that node. When such a node is linear-like (an LM head; see
:mod:`pipecut.passes.rewrite.chunk_rows`), the planner rewrites the graph with the node in row pieces,
each at most a share, profiles the rewritten graph, and keeps the result only where its
predicted step beats the plain plan's (see :func:`pipecut.planning.planner.plan`, ``chunk_heavy``).

:func:`heavy_chunks` and :func:`merge_costs` are pure: a cost table (and the graph, to ask what
is chunkable) in, plan data out. :func:`try_pieces` is the planner's step that uses them: it
profiles the rewritten graph where it changed and keeps the cheaper plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch.fx as fx

from pipecut.capture import as_planned
from pipecut.core.kinds import CostSource, NodeOp
from pipecut.core.program import Captured
from pipecut.ir import ChunkedNode, NodeCost, Plan
from pipecut.passes.partition.chain import is_unit
from pipecut.passes.rewrite.chunk_rows import chunkable, piece_names
from pipecut.planning.request import FirstBatch, Request, profile_at

__all__ = ["MAX_PIECES", "heavy_chunks", "merge_costs", "new_names", "try_pieces"]

MAX_PIECES = 16
"""More pieces than this only add small matmuls and a wider concatenation."""


def _cost(n: NodeCost) -> float:
    return n.forward_ms + n.backward_ms


def heavy_chunks(nodes: Sequence[NodeCost], stages: int, gm: fx.GraphModule) -> tuple[ChunkedNode, ...]:
    """The chunkable unit nodes of ``gm`` costing more than total / ``stages`` (forward +
    backward over the units of ``nodes``, ``gm``'s cost table), each in the fewest row pieces
    that cost at most total / ``stages`` apiece, but no more pieces than its operand has rows,
    nor than :data:`MAX_PIECES`. Fewest, not more: every piece computes a whole weight-sized
    gradient (the weight is used whole), which on a few hundred rows per microbatch is memory
    traffic rather than arithmetic, so each extra piece costs."""
    units = [n for n in nodes if is_unit(n)]
    total = sum(_cost(n) for n in units)
    if stages < 2 or total <= 0:
        return ()
    share = total / stages
    graph = {n.name: n for n in gm.graph.nodes}
    rows_of = {n.name: n.shape for n in nodes}
    chunks = []
    for n in units:
        if n.op is NodeOp.OUTPUT or _cost(n) <= share or n.name not in graph:
            continue
        node = graph[n.name]
        if chunkable(node, gm) is not None:
            continue
        operand = node.args[0]
        shape = rows_of.get(operand.name) if isinstance(operand, fx.Node) else None
        if shape is None or len(shape) < 2 or shape[-2] < 2:
            continue  # a vector, or one row: nothing to chunk
        pieces = min(math.ceil(_cost(n) / share), shape[-2], MAX_PIECES)
        if pieces >= 2:
            chunks.append(ChunkedNode(node=n.name, pieces=pieces))
    return tuple(chunks)


def new_names(chunks: Sequence[ChunkedNode]) -> frozenset[str]:
    """The nodes of the rewritten graph that the rewrite made: each chunked node's row chunks,
    pieces and concatenation (which keeps the node's name). Only these need timing."""
    names = {c.node for c in chunks}
    for c in chunks:
        rows, pieces = piece_names(c.node, c.pieces)
        names.update(rows + pieces)
    return frozenset(names)


def merge_costs(
    original: Sequence[NodeCost], rewritten: Sequence[NodeCost], chunks: Sequence[ChunkedNode]
) -> tuple[NodeCost, ...]:
    """``rewritten``'s table (the chunked graph's, in its order) with every node the rewrite left
    alone priced as in ``original``: the two plans then differ only where the graphs do, not by
    profiling noise, and their predicted steps compare fairly."""
    replaced = new_names(chunks)
    before = {n.name: n for n in original}
    return tuple(
        before[n.name] if n.name in before and n.name not in replaced else n for n in rewritten
    )


Partition = Callable[[Captured, Sequence[NodeCost], tuple[ChunkedNode, ...]], Plan]
"""``(graph, cost table, chunked nodes) -> plan``: the planner's partition (and calibration)."""


def try_pieces(request: Request, captured: Captured, batch: FirstBatch, best: Plan,
               nodes: Sequence[NodeCost], partition: Partition) -> tuple[Plan, str]:
    """``best``, or the plan with its heavy nodes in row pieces where that predicts a shorter
    step, and a note for the solver's detail. Only GPipe and (interleaved) 1F1B without a split
    given, with ``PartitionOptions.heavy_pieces``."""
    kind = best.schedule
    if not request.options.partition.heavy_pieces or request.options.partition.split is not None or kind.splits_backward:
        return best, ""
    chunks = heavy_chunks(best.nodes, best.num_stages, captured.gm)
    if not chunks:
        return best, ""
    chunked = as_planned(captured, chunks)
    estimated = any(n.source is CostSource.ESTIMATED for n in nodes)  # rates need every node
    pieces_table = profile_at(request, chunked, batch.inputs, batch.target,
                              only=None if estimated else new_names(chunks))
    tried = partition(chunked, merge_costs(best.nodes, pieces_table, chunks), chunks)
    keep = tried.predicted.step_ms < best.predicted.step_ms
    what = ", ".join(f"{c.node} in {c.pieces} row pieces" for c in chunks)
    note = (f"heavy node(s) {what}: predicted step {tried.predicted.step_ms:.3f} ms, "
            f"{best.predicted.step_ms:.3f} ms whole; {'chunked' if keep else 'kept whole'}")
    return (tried if keep else best), note
