"""Mark where a tensor-parallel stage computes on DTensors: its split regions.

A stage whose parameters are split over a tensor group holds them as DTensors; everything else
stays plain tensors, as Megatron keeps the residual stream whole::

    plain ─enter─▶ column product ─▶ … (DTensors: heads, hidden features) … ─▶ row product ─leave─▶ plain

:func:`shard_regions` inserts the two conversions, given as functions (the runtime binds them
to its mesh): ``enter`` on every value a DTensor computation reads that is still plain (a
replicated DTensor: its gradient is summed over the group when it flows back, Megatron's
``f``), and ``leave`` after every node that reads a parameter whose split ``reduces`` (a row
product, a vocabulary-split embedding: the partial sums are reduced, ``g``) and on every
DTensor the stage returns (gathered whole: the next stage, or the loss, reads plain values).
DTensor's own propagation does the rest, so the graph's shapes (head counts in views) stay the
model's and the result is the plain model's whatever the split; a split a region does not
expect (a cut between a column and its row product) costs a redistribution, never accuracy.

Attention inside a region (``scaled_dot_product_attention``, the op or the function) calls
``heads(op)`` instead of the op, where ``heads`` is given: each head's attention is
independent, so the runtime runs it on each rank's own heads (Megatron's way) instead of through
DTensor's propagation, which has no rule for the fused kernels torch picks.

``torch.export``'s checks of a value's dtype and device (``aten._assert_tensor_metadata``), which
DTensor has no rule for, are dropped inside regions: DTensor keeps both of its local tensors.

With sequence parallelism (Megatron's, Korthikanti et al. 2022) the residual stream between
regions is split too, along its tokens::

    tokens split ─enter (all-gather)─▶ column … row ─leave (reduce-scatter)─▶ tokens split ─▶ norm, residual add ─▶ …

``leave`` then splits a closing node's value along its tokens instead of making it whole, and
every node downstream of it that opens no region (norms, residual adds, dropout) runs on its
token shard: the *spread* nodes. ``enter`` gathers such a value wherever a region reads it; a
plain value a spread node reads is entered as replicated (DTensor takes this rank's tokens of
it). A token shard the stage sends on stays one (``sends_tokens``): the runtime sends this
rank's tokens and the next stage's placeholder receives them as the same shard (``arriving``:
its readers are spread nodes). Only what the last stage returns to the loss is made whole; a
closing value returned and read by nothing else (the head's logits) is made whole at once.

Each inserted call is marked :data:`~pipecut.core.graph.EAGER`: a stage compiled apart runs it
eagerly, between its compiled runs.

The input graph is not modified: the pass returns a new GraphModule over the same submodules.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable, Collection, Mapping

import torch
import torch.fx as fx
import torch.nn.functional as F

from pipecut.core.graph import EAGER, node_parameters
from pipecut.passes.parallel.tensor import ParameterShard

__all__ = ["ATTENTION", "Regions", "region_nodes", "shard_regions"]

_CHECKS = (torch.ops.aten._assert_tensor_metadata.default,)
ATTENTION = (torch.ops.aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention)
"""Scaled dot-product attention as captured graphs call it: the ATen op (torch.export) or the
function (symbolic_trace)."""


def _reads(node: fx.Node, gm: fx.GraphModule, shards: Mapping[str, ParameterShard]) -> list[ParameterShard]:
    """The splits of the parameters ``node`` reads itself (a module's own) or through get_attr."""
    direct = [*node_parameters(node, gm), *(p for a in node.all_input_nodes if a.op == "get_attr"
                                            for p in node_parameters(a, gm))]
    return [shards[fqn] for fqn, _ in direct if fqn in shards]


def _read_by(read: Callable[[fx.Node, fx.Node], fx.Node], by: fx.Node, a: fx.Node) -> fx.Node:
    return read(a, by)


@dataclasses.dataclass(frozen=True)
class Regions:
    """A stage's nodes by where their values live, by name."""

    inside: frozenset[str]
    """Nodes whose value is a DTensor of a split region (heads, hidden features)."""
    closing: frozenset[str]
    """Region nodes after which the region closes (a row product, a vocabulary-split embedding)."""
    spread: frozenset[str] = frozenset()
    """With sequence parallelism: nodes outside any region whose value is split along its tokens."""


def region_nodes(gm: fx.GraphModule, shards: Mapping[str, ParameterShard], sequence_parallel: bool = False,
                 arriving: Collection[str] = ()) -> Regions:
    """Every node's place (see :class:`Regions`): a node is inside a region if it reads a split
    parameter or a region's open value; with ``sequence_parallel``, a node that is not, and reads
    a closing or spread value, is spread, and so are the placeholders named in ``arriving``
    (received as token shards)."""
    inside: set[str] = set()
    closing: set[str] = set()
    spread: set[str] = set(arriving) if sequence_parallel else set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "get_attr":
            if any(fqn in shards for fqn, _ in node_parameters(node, gm)):
                inside.add(node.name)
            continue
        reads = _reads(node, gm, shards)
        if reads or any(a.name in inside and a.name not in closing for a in node.all_input_nodes):
            inside.add(node.name)
            if any(s.reduces for s in reads):
                closing.add(node.name)
        elif sequence_parallel and any(a.name in closing or a.name in spread for a in node.all_input_nodes):
            spread.add(node.name)
    return Regions(frozenset(inside), frozenset(closing), frozenset(spread))


def shard_regions(gm: fx.GraphModule, shards: Mapping[str, ParameterShard], *,
                  enter: Callable[[object], object], leave: Callable[[object], object],
                  whole: Callable[[object], object] | None = None,
                  join: Callable[[object], object] | None = None,
                  heads: Callable[[Callable[..., object]], Callable[..., object]] | None = None,
                  arriving: Collection[str] = (), sends_tokens: bool = False) -> fx.GraphModule:
    """A copy of ``gm`` with ``enter``/``leave`` calls around its split regions (see the module
    docstring), and ``whole`` (default ``leave``) on the DTensors it returns. ``join`` given,
    the residual stream is split along its tokens (sequence parallelism), and ``join`` takes
    what a spread node reads that may be plain (a replicated DTensor then; a DTensor as it is);
    the placeholders named in ``arriving`` are token shards, and with ``sends_tokens`` the
    token shards the graph returns are returned as they are. ``heads`` given, attention inside a
    region calls ``heads(op)`` with the op's arguments instead of ``op``. ``shards``: the split
    parameters by their names in ``gm``."""
    sequence_parallel = join is not None
    regions = region_nodes(gm, shards, sequence_parallel, arriving)
    inside, closing, spread = regions.inside, regions.closing, regions.spread
    out = whole or leave
    graph = fx.Graph()
    graph._codegen = copy.deepcopy(gm.graph._codegen)
    env: dict[fx.Node, fx.Node] = {}
    entered: dict[fx.Node, fx.Node] = {}
    left: dict[fx.Node, fx.Node] = {}  # a closing node's value after ``leave``
    joined: dict[fx.Node, fx.Node] = {}

    def as_read(a: fx.Node, by: fx.Node) -> fx.Node:
        value = left.get(a, env[a])
        if by.name in spread:
            if a.name in closing:
                return value  # a token shard
            if a not in joined:  # a token shard, or a plain value (a parameter, a shape's tensor)
                assert join is not None
                joined[a] = _end(graph, join, value)
            return joined[a]
        if by.name not in inside or (a.name in inside and a.name not in closing):
            return value
        if a.op == "get_attr" and a.name in inside:
            return value
        if a not in entered:
            entered[a] = _end(graph, enter, value)
        return entered[a]

    # a closing value only returned whole (the head's logits, to the loss) is made whole at once:
    # one all-gather or all-reduce, not a cut into token shards and a gather of them
    direct = {n for n in gm.graph.nodes if n.name in closing and not sends_tokens and n.users
              and all(u.op == "output" for u in n.users)}

    def returned(a: fx.Node) -> fx.Node:  # what the stage sends or returns: plain, or token shards sent on
        if a in left and (not sequence_parallel or a in direct):
            return left[a]
        if sends_tokens and a.name in closing | spread:
            return left.get(a, env[a])
        return _end(graph, out, left.get(a, env[a])) if a.name in inside | spread else env[a]

    for node in gm.graph.nodes:
        if node.op == "output":
            graph.output(fx.map_arg(node.args[0], returned))
            continue
        if node.name in inside | spread and node.target in _CHECKS and not node.users:
            continue
        env[node] = graph.node_copy(node, functools.partial(_read_by, as_read, node))
        if heads is not None and node.name in inside and node.target in ATTENTION:
            env[node].target = heads(node.target)
        if node.name in closing:
            left[node] = _end(graph, out if node in direct else leave, env[node])
    graph.lint()
    return fx.GraphModule(gm, graph, gm.__class__.__name__)


def _end(graph: fx.Graph, end: Callable[[object], object], value: fx.Node) -> fx.Node:
    """A call of a region end on ``value``, marked to run eagerly in a stage compiled apart."""
    node = graph.call_function(end, (value,))
    node.meta[EAGER] = True
    return node
